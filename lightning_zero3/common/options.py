"""The options both strategies take (Trainer's `ZeRO3Strategy`, Fabric's `ZeRO3FabricStrategy`),
checked once, at construction, with a message that says what was expected and how to fix it;
joining the process group with an error that names a rank that never arrived; and the rank and
device properties Lightning asks of both (`RanksAndDevices`).

[Note: Lightning's private names]
A strategy outside Lightning cannot avoid a few of Lightning's underscored names; each use is
listed here. Tried: Lightning 2.6.6 (the supported range is `lightning>=2.5,<2.7`). No fallback
is possible for the launchers (Lightning has no public launcher a strategy could use instead);
the version pin in pyproject.toml is the guard, and a rename fails at import, naming the missing
name, not mid-training.
- `_SubprocessScriptLauncher`, `_MultiProcessingLauncher` (both strategies): the launchers
  Lightning's own DDP/FSDP strategies set in `_configure_launcher`.
- Fabric's `_FabricModule._forward_module` (fabric_strategy.py): the module `fabric.setup`
  wrapped, to find the engine that holds it.
- The Trainer's `fit_loop.epoch_loop._batches_that_stepped` (summary.py `ShardingStatsMonitor`):
  the step `self.log` values are logged at; the fallback, `global_step - 1`, is the same number
  in an ordinary run (Lightning 2.6.6 tried).
- Fabric's `_BackwardSyncControl` and `Strategy._backward_sync_control` (fabric_strategy.py):
  what `fabric.no_backward_sync` calls; without it Fabric only warns.
"""

from __future__ import annotations

import atexit
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar, get_args

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from torch import nn

from lightning_zero3.checkpoint import CheckpointError, describe_error
from lightning_zero3.engine import CollectiveError, ShardedModel, ShardingConfig, config_field_names

T = TypeVar("T")
StateDictType = Literal["sharded", "full"]
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


@dataclass(frozen=True)
class LightningOptions:
    """The options only the Lightning strategies have (the engine's are `ShardingConfig`); the
    README's table says what each does.

    Args:
        state_dict_type: "sharded" (a directory, each rank its shards) or "full" (one file from rank 0).
        trust_checkpoint: unpickle checkpoint files without restriction (checkpoint/trust.py).
        timeout: process-group timeout: a rank that never arrives fails the others after it.
        start_method: "popen" (re-run the script per rank) or a multiprocessing start method.
        async_save: sharded saves write in a background thread (docs/checkpoints.md).
        accumulate_unsharded: micro-batches of `accumulate_grad_batches` Reduce-Scatter once
            (engine/accumulate.py).
    """

    state_dict_type: StateDictType = "sharded"
    trust_checkpoint: bool = False
    timeout: timedelta = timedelta(minutes=30)
    start_method: StartMethod = "popen"
    async_save: bool = False
    accumulate_unsharded: bool = False

    def __post_init__(self) -> None:
        for option, valid, expected in (
            ("state_dict_type", self.state_dict_type in get_args(StateDictType), f"one of {get_args(StateDictType)}"),
            ("trust_checkpoint", isinstance(self.trust_checkpoint, bool), "a bool"),
            (
                "timeout",
                isinstance(self.timeout, timedelta) and self.timeout > timedelta(0),
                "a datetime.timedelta longer than 0 (how long a rank waits for the others, e.g. timedelta(minutes=30))",
            ),
            ("async_save", isinstance(self.async_save, bool), "a bool"),
            ("accumulate_unsharded", isinstance(self.accumulate_unsharded, bool), "a bool"),
            ("start_method", self.start_method in get_args(StartMethod), f"one of {get_args(StartMethod)}"),
        ):
            if not valid:
                raise ValueError(f"LightningOptions({option}=...) must be {expected}; got {getattr(self, option)!r}.")


def split_options(owner: str, arguments: Mapping[str, Any]) -> tuple[ShardingConfig, LightningOptions]:
    """The options among a strategy's `__init__` arguments (its `locals()`: one keyword per field
    of both dataclasses) as the engine's config and the Lightning-only ones, each validated once;
    errors name `owner` (the strategy class) as the constructor the user called."""
    engine_names, lightning_names = config_field_names(ShardingConfig), config_field_names(LightningOptions)
    try:
        config = ShardingConfig(**{k: v for k, v in arguments.items() if k in engine_names})
        lightning = LightningOptions(**{k: v for k, v in arguments.items() if k in lightning_names})
    except ValueError as err:  # "ShardingConfig(prefetch=...) must be ..." -> "ZeRO3Strategy(prefetch=...) ..."
        message = re.sub(r"^(ShardingConfig|LightningOptions)\(", f"{owner}(", str(err))
        raise ValueError(message if message != str(err) else f"{owner}: {err}") from None
    return config, lightning


def build_engine(
    owner: str, module: nn.Module, config: ShardingConfig, *, precision: object, world_size: int, device: torch.device,
    timeout: timedelta | None = None,
) -> ShardedModel:  # fmt: skip
    """Shard `module` as both strategies do: the gather dtype defaults to what the precision
    plugin implies, and 16-bit compute under a 32-bit plugin is refused before anything changes."""
    narrow = config.param_dtype is not None and config.param_dtype.itemsize < 4
    flag = str(getattr(precision, "precision", ""))
    if narrow and flag in ("32-true", "64-true"):
        raise ValueError(
            f"{owner}(param_dtype={config.param_dtype}) computes in 16 bits, but the precision is {flag}, "
            f"so inputs stay fp32 and the first layer fails on mixed dtypes. Use precision='bf16-mixed' (autocast; "
            f"param_dtype then defaults to bf16) or cast inputs."
        )
    config = replace(
        config,
        param_dtype=config.param_dtype or {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(flag),
        shard_size=config.shard_size if config.shard_size != world_size else None,
    )
    try:
        return ShardedModel(module, config, device=device, timeout=timeout)  # its groups' timeout: ours
    except ValueError as err:  # the engine names its own way to build on meta (engine/materialize.py): add ours
        if "are tensors on the meta device" not in str(err):
            raise
        raise ValueError(
            f"{err} With {owner}: build it in `configure_model()` or under `trainer.init_module(empty_init=True)` "
            f"(Fabric: `fabric.init_module(empty_init=True)`), which defer only parameters too."
        ) from None


class CheckpointFiles(NamedTuple):
    """How a full checkpoint file is written, read and removed: by the user's CheckpointIO plugin
    (its own format and guarantees), or None for Lightning's default plugin, which the package's
    atomic writer, memory-mapped reader and remover replace (checkpoint/full.py)."""

    write: Callable[[dict[str, Any], Path], None] | None  # core.py's WriteFile, ReadFile, RemoveFile
    read: Callable[[Path], Any] | None
    remove: Callable[[Path], None] | None


def checkpoint_io_files(checkpoint_io: CheckpointIO, *, weights_only: bool | None = None) -> CheckpointFiles:
    if type(checkpoint_io) is TorchCheckpointIO:
        return CheckpointFiles(None, None, None)
    return CheckpointFiles(
        checkpoint_io.save_checkpoint,
        lambda path: checkpoint_io.load_checkpoint(path, weights_only=weights_only),
        checkpoint_io.remove_checkpoint,
    )


def _leave_process_group() -> None:
    if _distributed():
        torch.distributed.destroy_process_group()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# ---- what both strategies do the same way with the default process group -------------------
@contextmanager
def answered(owner: str, collective: str) -> Iterator[None]:
    """A control collective Lightning asks for (barrier, broadcast, reduce) that fails, because a
    rank was lost or went elsewhere, as a `CollectiveError` naming this rank and the others."""
    try:
        yield
    except RuntimeError as err:  # gloo's "Connection closed by peer", NCCL's or gloo's timeout, ...
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        others = [r for r in range(world) if r != rank]
        lost = f"rank {others[0]}" if len(others) == 1 else f"another rank (of ranks {others})"
        raise CollectiveError(
            f"{owner}: Lightning's {collective} failed on rank {rank} of {world}: {lost} stopped answering "
            f"({describe_error(err)}). Its log holds the cause (an exception there, the process killed, e.g. out "
            f"of memory), or it went another way: every rank must make the same calls (a checkpoint save, a barrier), "
            f"not only rank 0."
        ) from err


def _broadcast_object(obj: T, src: int) -> T:
    if not _distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def all_reduce(owner: str, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
    """`tensor` reduced in place over `group` (the world by default) with `reduce_op` (a
    `ReduceOp` or "sum", "mean"/"avg", "max", "min", "product"), as Lightning's strategies
    reduce logged values (and ModelCheckpoint's decisions); anything but a tensor, or without a
    process group, is returned as is; a rank lost is a `CollectiveError` naming `owner`."""
    if not isinstance(tensor, torch.Tensor) or not _distributed():
        return tensor
    group = torch.distributed.group.WORLD if group is None else group
    divide = False
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        divide = name == "avg" and torch.distributed.get_backend(group) == "gloo"  # gloo has no AVG
        op = torch.distributed.ReduceOp.SUM if divide else getattr(torch.distributed.ReduceOp, name.upper())
    else:
        op = reduce_op if reduce_op is not None else torch.distributed.ReduceOp.SUM
    with answered(owner, "reduce"):
        torch.distributed.barrier(group=group)
        torch.distributed.all_reduce(tensor, op=op, group=group)
    if divide:
        world = torch.distributed.get_world_size(group)
        return tensor.div_(world) if tensor.is_floating_point() else tensor.copy_(tensor / world)
    return tensor


class RanksAndDevices:
    """Lightning's rank and device properties, launcher and control collectives, the same for the Trainer's
    `ZeRO3Strategy` and Fabric's `ZeRO3FabricStrategy`: mixed in before Lightning's
    `ParallelStrategy` (Trainer and Fabric each have their own), which leaves them to each strategy."""

    _num_nodes: int  # set in the strategy's __init__
    _process_group_backend: str | None  # the user's choice, else resolved on joining
    _launchers: tuple[type, type]  # the API's own for start_method "popen", and for the others
    if TYPE_CHECKING:  # what the strategy's Lightning base provides
        cluster_environment: ClusterEnvironment | None
        _launcher: Any
        parallel_devices: list[torch.device] | None
        local_rank: int
        global_rank: int
        node_rank: int
        lightning_options: LightningOptions  # set in the strategy's __init__

    def _configure_launcher(self) -> None:  # "popen" also for ranks started outside: it sets their torch threads
        assert self.cluster_environment is not None
        popen, spawn = self._launchers
        if self.lightning_options.start_method == "popen":
            self._launcher = popen(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = spawn(self, start_method=self.lightning_options.start_method)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this rank's global rank and the world size, and
        Lightning's rank-zero utilities who rank zero is. The Trainer calls it by this name,
        Fabric as `_set_world_ranks`."""
        env = self.cluster_environment
        if env is not None:
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning's way; not in its stubs

    _set_world_ranks = set_world_ranks

    def setup_environment(self) -> None:
        """After the Lightning base's (next in the MRO): seed, ranks, backend, then join (or reuse)
        the default process group; a rank that never arrives fails the others after the `timeout`
        option with an error naming the address and the likely causes."""
        super().setup_environment()  # type: ignore[misc]  # the strategy's Lightning base
        timeout = self.lightning_options.timeout
        reset_seed()
        self.set_world_ranks()
        owner, env, device = type(self).__name__, self.cluster_environment, self.root_device
        assert env is not None
        backend = self._process_group_backend or torch.distributed.get_default_backend_for_device(device)
        self._process_group_backend = backend
        if not torch.distributed.is_available():
            raise RuntimeError(f"{owner} needs torch.distributed, which this torch build does not have.")
        if torch.distributed.is_initialized():
            return  # e.g. torchrun's script set it up, or a test harness
        # What Lightning's own strategies do (through a private helper): the store address from
        # the cluster environment, then the process group.
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        try:
            torch.distributed.init_process_group(
                backend, rank=env.global_rank(), world_size=env.world_size(), timeout=timeout,
                device_id=device if device.type != "cpu" else None,
            )  # fmt: skip
        except RuntimeError as err:  # torch's DistStoreError/DistNetworkError when a rank never arrives
            raise RuntimeError(
                f"{owner}: the {env.world_size()} ranks did not all join the process group at "
                f"{env.main_address}:{env.main_port} within timeout={timeout.total_seconds():g} s (this is "
                f"global rank {env.global_rank()}). Check that every node runs the same command with the same "
                f"num_nodes and devices, and that the main address and port are reachable. Cause: {err}"
            ) from err
        # Destroyed at exit, for every backend: NCCL warns about a group never destroyed, and gloo's
        # worker threads abort the process as Python finalizes (engine/comm.py, `new_group`).
        atexit.register(_leave_process_group)
        rank_zero_info(f"{owner}: {env.world_size()} processes joined the {backend} process group.")

    def barrier(self, name: str | None = None) -> None:
        """Lightning's (e.g. after `trainer.save_checkpoint`); a rank lost is a `CollectiveError`."""
        if _distributed():  # NCCL needs the device to wait on
            nccl = torch.distributed.get_backend() == "nccl"
            with answered(type(self).__name__, f"barrier{f' {name!r}' if name else ''}"):
                torch.distributed.barrier(device_ids=[self.root_device.index] if nccl else None)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """`obj` from rank `src` on every rank (pickled: small control values only), as Lightning
        (ModelCheckpoint) asks; a rank lost is a `CollectiveError`."""
        with answered(type(self).__name__, f"broadcast from rank {src}"):
            return _broadcast_object(obj, src)

    def broadcast_checkpoint_path(self, path: str | os.PathLike, *, saving: bool) -> str:
        """Rank 0's checkpoint path (or URL) on every rank, what a save or load begins with; a rank
        lost by then (e.g. during a save writing in the background) is a `CheckpointError`."""
        try:
            return _broadcast_object(os.fspath(path), 0)
        except RuntimeError as err:  # gloo's "Connection reset by peer", a timeout, ...
            unchanged = " (the previous checkpoint there, if any, is unchanged)" if saving else ""
            raise CheckpointError(
                f"Cannot {'save' if saving else 'load'} the checkpoint {os.fspath(path)}{unchanged}: another rank "
                f"stopped answering ({describe_error(err)}). Its log holds the cause."
            ) from err
