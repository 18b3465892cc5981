"""The options both strategies take (Trainer's `ZeRO3Strategy`, Fabric's `ZeRO3FabricStrategy`),
checked once, at construction, with a message that says what was expected and how to fix it;
joining the process group with an error that names a rank that never arrived; and the rank and
device properties Lightning asks of both (`RanksAndDevices`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol, TypeVar

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from torch import nn

from lightning_zero3.engine.plan import WrapPolicy, validate_wrap_policy

T = TypeVar("T")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
STATE_DICT_TYPES = ("sharded", "full")

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "64": torch.float64,
}  # fmt: skip


@dataclass(frozen=True)
class ShardingOptions:
    """What the user chose, validated and normalised (dtype names turned into dtypes)."""

    wrap_policy: WrapPolicy
    prefetch: int
    persistence_threshold: int
    shard_size: int | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    param_init_fn: Callable[[nn.Module], None] | None
    state_dict_type: str
    timeout: timedelta
    start_method: StartMethod
    # Reduce-Scatters left running while backward continues; None: 2 on CUDA, 0 elsewhere.
    reductions_in_flight: int | None = None
    # Unpickle checkpoint files without restrictions (checkpoint/trust.py).
    trust_checkpoint: bool = False


def validated_options(
    owner: str,
    *,
    wrap_policy: object,
    prefetch: object,
    persistence_threshold: object,
    shard_size: object,
    param_dtype: object,
    reduce_dtype: object,
    param_init_fn: object,
    state_dict_type: object,
    timeout: object,
    start_method: object,
    reductions_in_flight: object = None,
    trust_checkpoint: object = False,
) -> ShardingOptions:
    """Check every option; raise `ValueError` naming `owner` (the class), the option and the fix."""
    if type(prefetch) is not int or prefetch < 0:
        raise ValueError(f"{owner}(prefetch=...) must be an int >= 0, got {prefetch!r}.")
    if type(persistence_threshold) is not int or persistence_threshold < 0:
        raise ValueError(
            f"{owner}(persistence_threshold=...) must be an int >= 0 (elements), got {persistence_threshold!r}."
        )
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"{owner}(state_dict_type=...) must be one of {STATE_DICT_TYPES}, got {state_dict_type!r}.")
    if start_method not in START_METHODS:
        raise ValueError(f"{owner}(start_method=...) must be one of {START_METHODS}, got {start_method!r}.")
    if not isinstance(timeout, timedelta):
        raise ValueError(f"{owner}(timeout=...) must be a datetime.timedelta, got {timeout!r}.")
    if shard_size is not None and (type(shard_size) is not int or shard_size < 1):
        raise ValueError(
            f"{owner}(shard_size=...) must be None (whole world) or a positive int that divides the number of "
            f"ranks, e.g. the devices per node; got {shard_size!r}."
        )
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"{owner}(param_init_fn=...) must be callable; got {param_init_fn!r}.")
    if reductions_in_flight is not None and (type(reductions_in_flight) is not int or reductions_in_flight < 0):
        raise ValueError(
            f"{owner}(reductions_in_flight=...) must be None (2 on CUDA, 0 elsewhere) or an int >= 0 "
            f"(Reduce-Scatters left running while backward continues); got {reductions_in_flight!r}."
        )
    if not isinstance(trust_checkpoint, bool):
        raise ValueError(f"{owner}(trust_checkpoint=...) must be a bool, got {trust_checkpoint!r}.")
    return ShardingOptions(
        wrap_policy=validate_wrap_policy(wrap_policy),
        prefetch=prefetch,
        persistence_threshold=persistence_threshold,
        shard_size=shard_size,
        param_dtype=as_dtype(param_dtype, "param_dtype", owner),
        reduce_dtype=as_dtype(reduce_dtype, "reduce_dtype", owner),
        param_init_fn=param_init_fn,  # type: ignore[arg-type]
        state_dict_type=state_dict_type,  # type: ignore[arg-type]
        timeout=timeout,
        start_method=start_method,  # type: ignore[arg-type]
        reductions_in_flight=reductions_in_flight,  # type: ignore[arg-type]
        trust_checkpoint=trust_checkpoint,
    )


def as_dtype(value: object, option: str, owner: str = "ZeRO3Strategy") -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(
        f"{owner}({option}=...) must be a floating torch.dtype or one of {sorted(_DTYPES)}; got {value!r}."
    )


def mixed_precision_dtype(precision: str) -> torch.dtype | None:
    """The gather dtype a precision flag implies: 16-bit for the "-mixed" flags."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def join_process_group(
    owner: str, env: ClusterEnvironment, backend: str, *, timeout: timedelta, device: torch.device
) -> None:
    """Join (or reuse) the default process group; a rank that never arrives fails the others after
    `timeout` with an error naming the address and the likely causes."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    try:
        _init_dist_connection(env, backend, **kwargs)
    except RuntimeError as err:  # torch's DistStoreError/DistNetworkError when a rank never arrives
        raise RuntimeError(
            f"{owner}: the {env.world_size()} ranks did not all join the process group at "
            f"{env.main_address}:{env.main_port} within timeout={timeout.total_seconds():g} s (this is "
            f"global rank {env.global_rank()}). Check that every node runs the same command with the same "
            f"num_nodes and devices, and that the main address and port are reachable. Cause: {err}"
        ) from err


# ---- what both strategies do the same way with the default process group -------------------
def barrier(device: torch.device) -> None:
    """Wait for every rank (NCCL needs the device to wait on)."""
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[device.index])
    else:
        torch.distributed.barrier()


def broadcast_object(obj: T, src: int) -> T:
    """`obj` from rank `src` on every rank (pickled: small control values only)."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


class _LightningParallel(Protocol):
    """What `RanksAndDevices` reads from the Lightning strategy it is mixed into."""

    cluster_environment: ClusterEnvironment | None
    _num_nodes: int  # set in the strategy's __init__
    _process_group_backend: str | None  # the user's choice, else resolved on joining

    @property
    def parallel_devices(self) -> list[torch.device] | None: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def num_processes(self) -> int: ...
    def set_world_ranks(self) -> None: ...


class RanksAndDevices:
    """Lightning's rank and device properties and control collectives, the same for the Trainer's
    `ZeRO3Strategy` and Fabric's `ZeRO3FabricStrategy`: mixed in before Lightning's
    `ParallelStrategy` (Trainer and Fabric each have their own), which leaves them to each strategy."""

    _num_nodes: int  # set in the strategy's __init__
    _process_group_backend: str | None  # the user's choice, else resolved on joining

    @property
    def root_device(self: _LightningParallel) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self: _LightningParallel) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self: _LightningParallel, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self: _LightningParallel) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self: _LightningParallel) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self: _LightningParallel) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self: _LightningParallel) -> None:
        """Tell the cluster environment this rank's global rank and the world size, and
        Lightning's rank-zero utilities who rank zero is. The Trainer calls it by this name,
        Fabric as `_set_world_ranks`."""
        env = self.cluster_environment
        if env is not None:
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning's way; not in its stubs

    _set_world_ranks = set_world_ranks

    def join_world(self: _LightningParallel, timeout: timedelta) -> None:
        """`setup_environment` after Lightning's own: seed, ranks, backend, the process group."""
        reset_seed()
        self.set_world_ranks()
        device = self.root_device
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        join_process_group(type(self).__name__, self.cluster_environment, backend, timeout=timeout, device=device)

    def barrier(self: _LightningParallel, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return broadcast_object(obj, src)
