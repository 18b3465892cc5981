"""`ShardedStrategy`: the base both strategies derive from (Trainer's `ZeRO3Strategy`, Fabric's
`ZeRO3FabricStrategy`), mixed in before Lightning's `ParallelStrategy` (each API has its own): the
rank and device properties, the launcher, joining the process group with an error that names a rank
that never arrived, the control collectives Lightning asks for, and what both offer on a model.

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
- The Trainer's `fit_loop.epoch_loop._batches_that_stepped` (tools/summary.py `ShardingStatsMonitor`):
  the step `self.log` values are logged at; the fallback, `global_step - 1`, is the same number
  in an ordinary run (Lightning 2.6.6 tried).
- Fabric's `_BackwardSyncControl` and `Strategy._backward_sync_control` (fabric_strategy.py):
  what `fabric.no_backward_sync` calls; without it Fabric only warns.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.seed import reset_seed

from lightning_zero3.checkpoint import CheckpointError, describe_error
from lightning_zero3.common.run import ReadFile, RemoveFile, ShardedRun, WriteFile
from lightning_zero3.engine import CollectiveError, ShardedModel

if TYPE_CHECKING:
    from lightning_zero3.common.options import LightningOptions

T = TypeVar("T")


class CheckpointFiles(NamedTuple):
    """How a full checkpoint file is written, read and removed: by the user's CheckpointIO plugin
    (its own format and guarantees), or None for Lightning's default plugin, which the package's
    atomic writer, memory-mapped reader and remover replace (checkpoint/full.py)."""

    write: WriteFile | None
    read: ReadFile | None
    remove: RemoveFile | None


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


class ShardedStrategy:
    """What the Trainer's and Fabric's strategies do alike: Lightning's rank and device properties,
    launcher and control collectives, and the operations on the models they shard; each finds a
    module's run with its own `_run_of` (one LightningModule, or each model `fabric.setup` got)."""

    description: str  # in Lightning's registry of strategies, under "zero3"
    which: str  # which API the class serves, and the class the other one wants
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

    def _run_of(self, module: Any = None, *, within: bool = False) -> ShardedRun:
        raise NotImplementedError

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's: the name "zero3" for this class (each API has its own registry)."""
        if "zero3" not in strategy_registry:
            strategy_registry.register("zero3", cls, description=cls.description)

    def __repr__(self) -> str:  # shown by the other API when given this class: say which one it wants
        return f"{type(self).__name__}({self.which} or strategy='zero3')"

    def sharded_model(self, module: Any = None) -> ShardedModel:
        """The engine holding `module`'s shards (a model set up, or the wrapper `fabric.setup`
        returned); with one model set up, `module` may be omitted."""
        return self._run_of(module).engine

    def gathered_parameters(self, module: Any = None, *, modifier_rank: int | None = None) -> AbstractContextManager:
        """Make the parameters of `module` (default: the whole model; or a submodule of it) whole
        on every rank inside the block. With `modifier_rank=r`, what rank r wrote is kept on exit."""
        owner = self._run_of(module, within=True).engine
        target = None if module is None or module is owner.module else getattr(module, "_forward_module", module)
        return owner.gathered_parameters(target, modifier_rank=modifier_rank)

    def release_buffers(self, module: Any = None) -> None:
        """Give the engine's pooled gather and reduction buffers back to the allocator (e.g. before
        a memory-hungry evaluation); the next step makes them again. Teardown does it too."""
        self._run_of(module).engine.release_buffers()

    def gathered_for_inference(self, module: Any = None) -> AbstractContextManager:
        """Keep every unit of `module` (default: the only model) gathered inside the block (no
        gradients), so `generate()` and evaluation run at DDP's speed (`ShardedModel.gathered_for_inference`)."""
        return self._run_of(module, within=True).engine.gathered_for_inference()

    # ---- ranks, devices, the launcher and the process group
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
                backend,
                rank=env.global_rank(),
                world_size=env.world_size(),
                timeout=timeout,
                device_id=device if device.type != "cpu" else None,
            )
        except RuntimeError as err:  # torch's DistStoreError/DistNetworkError when a rank never arrives
            raise RuntimeError(
                f"{owner}: the {env.world_size()} ranks did not all join the process group at "
                f"{env.main_address}:{env.main_port} within timeout={timeout.total_seconds():g} s (this is "
                f"global rank {env.global_rank()}). Check that every node runs the same command with the same "
                f"num_nodes and devices, and that the main address and port are reachable. Cause: {err}"
            ) from err
        # Destroyed at exit, for every backend: NCCL warns about a group never destroyed, and gloo's
        # worker threads abort the process as Python finalizes (engine/groups.py, `new_group`).
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
