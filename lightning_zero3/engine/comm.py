"""The only module that calls torch.distributed. It takes the process group explicitly and
counts what every collective moves, so the accounting in `CommStats` is measured, not modelled.

Bytes are counted two ways per collective:
- payload: the size of the full tensor the collective produces or consumes (All-Gather: the
  gathered output; Reduce-Scatter: the unreduced input; All-Reduce: the tensor);
- wire: what one rank sends with the ring algorithm, (N-1)/N of the payload for All-Gather and
  Reduce-Scatter and 2(N-1)/N for All-Reduce. It is zero on one rank.
How the rows of an All-Gather or a Reduce-Scatter move is the transport's, chosen once per
process group and device (transport.py).

[Note: streams]
On CUDA the engine's communication runs beside the compute, as PyTorch FSDP2 does: a gather's
copy-in (shards -> send row) runs on a copy-in stream that first waits for the compute stream
(the optimizer may just have written the shards); the All-Gather is issued from a gather stream
that waits for the copy-in's event; a Reduce-Scatter's copy-in and issue run on a reduce
stream that waits for the compute stream (the gradients are written there). Consumers wait for
an event recorded after the issue, then for the collective's work (on NCCL both are waits of
the current stream, not of the host). `Streams` owns the streams and events, one per device
and process group; on CPU every method is a no-op and everything runs in program order.
Buffers move between streams through the `BufferPool`, one stream per role (buffers.py, Note:
buffer roles and streams).

[Note: collective device]
A `Comm` built with `device` takes tensors of that device type only, on every backend: NCCL
has no path for CPU tensors ("No backend type associated with device type cpu", or a crash),
and gloo, which takes both, would hide such a call in every CPU test. So every collective
checks its tensors first and raises `CollectiveError` naming them; callers holding state
elsewhere (optimizer state Lightning's teardown moved to the host) copy it to `device`
one tensor at a time (state.py).
"""

from __future__ import annotations

import atexit
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero3.engine.buffers import BufferPool, current_event
from lightning_zero3.engine.transport import Transport, choose_transport


class Collective(str, Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    OBJECT = "object"  # pickled control messages (order checks); never on the per-step path


@dataclass
class CollectiveBytes:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0

    def add(self, payload: int, wire: int) -> None:
        self.calls += 1
        self.payload_bytes += payload
        self.wire_bytes += wire


@dataclass
class CommStats:
    """Bytes per collective kind, for the step in progress and for the last finished step."""

    current: dict[str, CollectiveBytes] = field(default_factory=lambda: defaultdict(CollectiveBytes))
    last_step: dict[str, CollectiveBytes] = field(default_factory=dict)
    # Seconds spent blocked waiting for All-Gathers: what prefetch failed to hide. On CPU the
    # host blocks in `wait()`; on CUDA the compute stream does, timed by events read only when
    # `last_step_gather_wait_s` is (a sync then, never during the step).
    gather_wait_s: float = 0.0
    _last_host_s: float = 0.0
    waits: list[tuple[Any, Any]] = field(default_factory=list)  # (start, end) CUDA events
    _last_waits: list[tuple[Any, Any]] = field(default_factory=list)

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        self.current = defaultdict(CollectiveBytes)
        self._last_host_s, self._last_waits = self.gather_wait_s, self.waits
        self.gather_wait_s, self.waits = 0.0, []

    @property
    def last_step_gather_wait_s(self) -> float:
        """Seconds the last step waited for All-Gathers (host on CPU, compute stream on CUDA)."""
        stalled = 0.0
        for start, end in self._last_waits:
            end.synchronize()
            stalled += start.elapsed_time(end) / 1e3
        return self._last_host_s + stalled


class CollectiveError(RuntimeError):
    """A collective failed or returned data from a different unit on another rank."""


# Appended to every failed collective: the error a rank sees is often the echo of another's.
COLLECTIVE_HINT = (
    " If another rank failed first, its log holds the cause. Ranks that run different units "
    "(data-dependent control flow) also end this way when the units differ in size; on NCCL, "
    "which does not compare message sizes, that shows as this timeout. Rerun with "
    "TORCH_DISTRIBUTED_DEBUG=DETAIL to have every collective's kind and size compared across "
    "ranks (docs/multi-node.md)."
)


class Streams:
    """The streams and events of one device's collectives (Note: streams)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        self._streams: dict[str, Any] = {}
        if self.enabled:
            # High priority, as FSDP2's: communication is what the compute waits for.
            names = ("copy_in", "gather", "reduce", "replicate")
            self._streams = {name: torch.cuda.Stream(device, priority=-1) for name in names}

    @contextmanager
    def on(self, name: str | None, *, after: Any = None, wait_current: bool | None = None) -> Iterator[None]:
        """Run the block on stream `name` ("copy_in", "gather", "reduce", "replicate"; None: the
        current one). "copy_in" and "reduce" first wait for the current stream unless `wait_current`
        says otherwise; `after`: an event to wait for too."""
        if not self.enabled or name is None:
            yield
            return
        stream = self._streams[name]
        if wait_current if wait_current is not None else name != "gather":
            stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield

    def event(self) -> Any:
        """An event after the work queued so far on the current stream (None on CPU)."""
        return current_event(self.device) if self.enabled else None

    def wait_for(self, event: Any) -> None:
        """Make the current stream wait for `event` (no host wait)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class Comm:
    """Collectives over one process group. With no process group (one process, no
    torch.distributed) every collective is a local copy, so the engine runs unchanged."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, pool: BufferPool | None = None,
        device: torch.device | None = None, stats: CommStats | None = None,
    ) -> None:  # fmt: skip
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        # Shared by the Comms whose traffic is counted together (model.py).
        self.stats = stats if stats is not None else CommStats()
        # Receive buffers of a transport that needs them (gloo.py).
        self.pool = pool or BufferPool()
        # The device the group's collectives take (Note: collective device); None: any.
        self.device = device
        self._device_type = device.type if device is not None else "cpu"
        # One rank: collectives are local copies. benchmarks/gpu_check.py turns it off to run
        # real NCCL collectives at world size 1.
        self._one_rank_shortcut = True
        # How All-Gathers and Reduce-Scatters move, chosen once (transport.py).
        self.transport = self._choose()
        # Streams per device (Note: streams).
        self._streams: dict[torch.device, Streams] = {}
        # The last collectives this rank issued, named, for the message of a failed one.
        self.recent: deque[str] = deque(maxlen=6)
        # What the engine knows about the step in progress (the recorded order), for messages.
        self.describe_step: Callable[[], str] | None = None

    def _choose(self) -> Transport:
        group = self.group if self.distributed else None
        return choose_transport(group, world_size=self.world_size, rank=self.rank, pool=self.pool,
                                device_type=self._device_type, one_rank_shortcut=self._one_rank_shortcut)  # fmt: skip

    @property
    def one_rank_shortcut(self) -> bool:
        return self._one_rank_shortcut

    @one_rank_shortcut.setter
    def one_rank_shortcut(self, value: bool) -> None:
        self._one_rank_shortcut = value
        self.transport = self._choose()

    def streams(self, device: torch.device) -> Streams:
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = Streams(device)
        return streams

    def failed(self, collective: str, what: str, err: BaseException) -> CollectiveError:
        """The error to raise when `collective` of `what` failed on this rank: it names the
        last collectives this rank issued and the recorded order, the usual suspects."""
        recent = ", ".join(self.recent) or "none"
        step = f" {self.describe_step()}." if self.describe_step is not None else ""
        return CollectiveError(
            f"{collective} of {what} failed on rank {self.rank}: {err}. This rank's last collectives, "
            f"oldest first: {recent}.{step}{COLLECTIVE_HINT}"
        )

    def _check_device(self, collective: str, what: str, *tensors: torch.Tensor) -> None:
        """Raise unless every tensor is on this group's device type (Note: collective device)."""
        if self.device is None:
            return
        for tensor in tensors:
            if tensor.device.type != self.device.type:
                raise CollectiveError(
                    f"{collective} of {what}: a tensor on {tensor.device}, but this process group's collectives "
                    f"take {self.device.type} tensors ({self.device}). NCCL takes CUDA tensors only and fails "
                    f"or crashes on others. This is a lightning_zero3 bug: the caller must copy the tensor to "
                    f"{self.device} first; please report it."
                )

    def _count(self, kind: Collective, payload_bytes: int, ring_factor: float) -> None:
        n = self.world_size
        wire = int(round(ring_factor * (n - 1) / n * payload_bytes))
        self.stats.current[kind.value].add(payload_bytes, wire)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool, what: str) -> Any:
        """Gather `shard` (same numel on every rank) into `output` (world_size x shard), rank-major.
        `shard` may be this rank's row of `output` itself (in place: nothing is copied)."""
        self._check_device("All-Gather", what, output)
        self._count(Collective.ALL_GATHER, output.numel() * output.element_size(), 1.0)
        self.recent.append(f"All-Gather of {what}")
        rows = output.view(self.world_size, -1)
        if shard.data_ptr() != rows[self.rank].data_ptr():
            rows[self.rank].copy_(shard.view(-1))
        return self._run("All-Gather", what, lambda: self.transport.all_gather(rows), async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, *, what: str, async_op: bool = False) -> Any:
        """Sum `full` (world_size x chunk, rank-major) over ranks; this rank keeps its chunk in
        `output`. `full` must not change until the returned work is waited for."""
        self._check_device("Reduce-Scatter", what, output, full)
        self._count(Collective.REDUCE_SCATTER, full.numel() * full.element_size(), 1.0)
        self.recent.append(f"Reduce-Scatter of {what}")
        rows = full.view(self.world_size, -1)
        return self._run("Reduce-Scatter", what, lambda: self.transport.reduce_scatter(output, rows), async_op)

    def _run(self, collective: str, what: str, issue: Callable[[], Any], async_op: bool) -> Any:
        try:
            work = issue()
            if work is not None and not async_op:
                work.wait()
                return None
            return work
        except RuntimeError as err:
            raise self.failed(collective, what, err) from err

    def all_reduce(self, tensor: torch.Tensor, *, what: str, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce `tensor` over ranks in place (`op`: "sum" or "max"); with `async_op`, return
        the work to wait for."""
        self._check_device("All-Reduce", what, tensor)
        self._count(Collective.ALL_REDUCE, tensor.numel() * tensor.element_size(), 2.0)
        self.recent.append(f"All-Reduce of {what}")
        if not self.distributed:
            return None
        try:
            reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
            return dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=async_op)
        except RuntimeError as err:
            raise self.failed("All-Reduce", what, err) from err

    def broadcast(self, tensor: torch.Tensor, *, src: int, what: str) -> None:
        """Copy `tensor` from group rank `src` to every rank, in place."""
        self._check_device("Broadcast", what, tensor)
        self._count(Collective.BROADCAST, tensor.numel() * tensor.element_size(), 1.0)
        if not self.distributed:
            return
        assert self.group is not None
        try:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)
        except RuntimeError as err:
            raise self.failed("Broadcast", what, err) from err

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order. For rare control messages only."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        self.stats.current[Collective.OBJECT.value].add(0, 0)
        return out

    @staticmethod
    def completed(work: Any) -> bool:
        """Whether an async collective has completed (or failed); never waits."""
        return work is None or bool(work.is_completed())

    def wait(self, work: Any, device: torch.device | None = None) -> None:
        """Wait on an async All-Gather, charging the time blocked to `gather_wait_s`: on CUDA
        (`device`) `work.wait()` only makes the current stream wait, so events time the stall."""
        if work is None:
            return
        if device is not None and device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            work.wait()
            end.record()
            self.stats.waits.append((start, end))
            return
        start_s = time.perf_counter()
        work.wait()
        self.stats.gather_wait_s += time.perf_counter() - start_s


def consecutive_group(size: int) -> dist.ProcessGroup | None:
    """Split the world into groups of `size` consecutive ranks; this rank's (`size` divides the
    world). Every rank must call it (creating a group is a collective)."""
    rank, mine = dist.get_rank(), None
    for start in range(0, dist.get_world_size(), size):
        group = new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine


def hybrid_groups(shard_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Split the world into groups of `shard_size` consecutive ranks that shard the model (one
    group per node, when `shard_size` is the processes per node) and groups of the ranks at
    the same position in each of them, which hold the same shards and average gradients.
    Returns (shard group, replicate group); (None, None) means the whole world shards.
    Every rank must call it (creating a group is a collective)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1 or world % shard_size:
        raise ValueError(
            f"shard_size must be a positive int that divides the world size {world} (e.g. the processes "
            f"per node); got {shard_size!r}."
        )
    if shard_size == world:
        return None, None
    rank = dist.get_rank()
    shard_group, replicate_group = consecutive_group(shard_size), None
    for offset in range(shard_size):
        group = new_group(list(range(offset, world, shard_size)))
        if rank % shard_size == offset:
            replicate_group = group
    return shard_group, replicate_group


def new_group(ranks: list[int] | None = None, *, backend: str | None = None) -> dist.ProcessGroup:
    """`dist.new_group` (collective), destroyed at interpreter exit if still alive: a gloo group
    never destroyed leaves worker threads that abort the process as Python finalizes
    ("terminate called without an active exception"); NCCL warns."""
    group = dist.new_group(ranks=ranks, backend=backend)
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        atexit.register(destroy_group, group)
    return group


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Destroy `group` if it still exists (no collective); `destroy_process_group()` may have
    destroyed every group already."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError):
        pass  # destroyed already
