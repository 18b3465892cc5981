"""The only module that calls torch.distributed. It takes the process group explicitly and
counts what every collective moves, so the accounting in `CommStats` is measured, not modelled.

Bytes are counted two ways per collective:
- payload: the size of the full tensor the collective produces or consumes (All-Gather: the
  gathered output; Reduce-Scatter: the unreduced input; All-Reduce: the tensor);
- wire: what one rank sends with the ring algorithm, (N-1)/N of the payload for All-Gather and
  Reduce-Scatter and 2(N-1)/N for All-Reduce. It is zero on one rank. Through the shared-memory
  transport (shm.py) nothing goes over a wire: there "wire" counts what the other ranks read of
  this rank's data out of the shared file, which is the same (N-1)/N of the payload (its row,
  read by N-1 ranks; its N-1 rows of the gradient, read by one rank each). The transport's
  barrier, one 32-byte gloo All-Reduce per collective, is its own synchronisation, as gloo's
  handshakes are, and is not counted.

[Note: gloo]
gloo's All-Gather receives into a temporary buffer and copies it out, and its Reduce-Scatter
clones the whole input, All-Reduces it (twice the bytes on the wire) and copies this rank's
chunk out: allocations and copies as large as the unit, every time. On CPU tensors under gloo
both are therefore built from torch.distributed operations that work in place: the All-Gather
is one broadcast per rank, each rank the source of its own row of the output; the
Reduce-Scatter sends every other rank its row and receives theirs (send/recv), then sums the
rows in rank order. Each rank sends (N-1)/N of the payload either way, as the ring would, and
the measured step time drops (docs/performance.md). NCCL (and anything else) gets the native
collectives.

[Note: streams]
On CUDA the engine's communication runs beside the compute, as PyTorch FSDP2 does: a gather's
copy-in (shards -> send row) runs on a copy-in stream that first waits for the compute stream
(the optimizer may just have written the shards); the All-Gather is issued from a gather stream
that waits for the copy-in's event; a Reduce-Scatter's copy-in and issue run on a reduce
stream that waits for the compute stream (the gradients are written there). Consumers wait for
an event recorded after the issue, then for the collective's work (on NCCL both are waits of
the current stream, not of the host). `Streams` owns the streams and events, one per device
and process group; on CPU every method is a no-op and everything runs in program order.
Buffers move between streams through the `BufferPool`, which records an event when a buffer
is given back and makes the next taker's stream wait for it (buffers.py).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero3.engine.buffers import BufferPool, current_event
from lightning_zero3.engine.shm import SharedArena
from lightning_zero3.engine.tags import TagLedger


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
    # Seconds spent blocked in `wait()` on All-Gathers: what prefetch failed to hide. On the
    # shared-memory transport, which is synchronous, the whole asynchronous-path All-Gather.
    gather_wait_s: float = 0.0
    last_step_gather_wait_s: float = 0.0

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        self.current = defaultdict(CollectiveBytes)
        self.last_step_gather_wait_s = self.gather_wait_s
        self.gather_wait_s = 0.0


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
            self._streams = {name: torch.cuda.Stream(device) for name in ("copy_in", "gather", "reduce")}

    @contextmanager
    def on(self, name: str | None, *, after: Any = None, wait_current: bool | None = None) -> Iterator[None]:
        """Run the block on stream `name` ("copy_in", "gather", "reduce"; None: the current
        one). "copy_in" and "reduce" first wait for the current stream unless `wait_current`
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

    def __init__(self, group: dist.ProcessGroup | None = None, *, pool: BufferPool | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.stats = CommStats()
        # Receive buffers of the send/recv Reduce-Scatter (Note: gloo).
        self.pool = pool or BufferPool()
        # Build CPU collectives from in-place operations (Note: gloo); tests turn it off to run
        # the native collectives, the path NCCL takes.
        self.gloo_in_place = self.distributed and "gloo" in str(dist.get_backend(self.group))
        # Same-host ranks: CPU All-Gathers and Reduce-Scatters through shared memory (shm.py,
        # Note: shared-memory transport); None: through the process group.
        self.shared: SharedArena | None = None
        # One rank: collectives are local copies. benchmarks/gpu_check.py turns it off to run
        # real NCCL collectives at world size 1.
        self.one_rank_shortcut = True
        # Global rank of each group rank: point-to-point calls and broadcasts name global ranks.
        self._global = [self._global_rank(r) for r in range(self.world_size)] if self.distributed else []
        # Unit tags received, checked once per step (tags.py); the model names the units.
        self.tags = TagLedger(rank=self.rank, unit_name=lambda uid: f"unit {uid}")
        # Streams per device (Note: streams).
        self._streams: dict[torch.device, Streams] = {}
        # Reductions whose All-Reduce across shard groups has not been issued yet, oldest first.
        self.awaiting_replication: list[tuple[Any, Any]] = []
        # The last collectives this rank issued, named, for the message of a failed one.
        self.recent: deque[str] = deque(maxlen=6)
        # What the engine knows about the step in progress (the recorded order), for messages.
        self.describe_step: Any = None

    def streams(self, device: torch.device) -> Streams:
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = Streams(device)
        return streams

    def advance_reductions(self, until: Any = None) -> None:
        """Issue the All-Reduce across shard groups of every reduction still waiting for it
        (all of them, or those up to `until`), in the order the reductions started, so every
        rank issues them alike."""
        if until is not None and all(p is not until for _, p in self.awaiting_replication):
            return
        while self.awaiting_replication:
            unit, pending = self.awaiting_replication.pop(0)
            unit.start_replication(pending)
            if pending is until:
                return

    def use_shared_memory(self, set_bytes: int) -> None:
        """Send CPU All-Gathers and Reduce-Scatters of up to `set_bytes` through a shared-memory
        file (shm.py); larger ones keep the process group. Collective: every rank calls it."""
        if not self.distributed or self.world_size == 1:
            return
        assert self.group is not None
        backend = str(dist.get_backend(self.group))
        if "gloo" not in backend:  # the barrier is an All-Reduce of a CPU tensor
            raise ValueError(
                f"cpu_transport='shared_memory' needs a process group that takes CPU tensors (gloo); this one is "
                f"{backend!r}. Use cpu_transport='process_group'."
            )
        group = self.group

        def barrier_max(flag: torch.Tensor) -> None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)

        self.shared = SharedArena(rank=self.rank, world_size=self.world_size, set_bytes=set_bytes,
                                  exchange=self.all_gather_object, all_reduce_max=barrier_max)  # fmt: skip

    def _through_shared(self, tensor: torch.Tensor, nbytes: int) -> SharedArena | None:
        """The arena to run a collective on `tensor` moving `nbytes` through, or None."""
        shared = self.shared
        if shared is None or tensor.device.type != "cpu" or not shared.fits(nbytes):
            return None
        return shared

    def _in_place(self, tensor: torch.Tensor) -> bool:
        """Whether collectives on `tensor` are built from in-place operations (Note: gloo)."""
        return self.gloo_in_place and tensor.device.type == "cpu" and self.world_size > 1

    def failed(self, collective: str, what: str, err: BaseException) -> CollectiveError:
        """The error to raise when `collective` of `what` failed on this rank: it names the
        last collectives this rank issued and the recorded order, the usual suspects."""
        recent = ", ".join(self.recent) or "none"
        step = f" {self.describe_step()}." if self.describe_step is not None else ""
        return CollectiveError(
            f"{collective} of {what} failed on rank {self.rank}: {err}. This rank's last collectives, "
            f"oldest first: {recent}.{step}{COLLECTIVE_HINT}"
        )

    def _global_rank(self, group_rank: int) -> int:
        """The global rank of `group_rank`; only when distributed, where `group` is always set."""
        assert self.group is not None
        return dist.get_global_rank(self.group, group_rank)

    def _count(self, kind: Collective, payload_bytes: int, ring_factor: float) -> None:
        n = self.world_size
        wire = int(round(ring_factor * (n - 1) / n * payload_bytes))
        self.stats.current[kind.value].add(payload_bytes, wire)

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, *, async_op: bool, what: str, fill_own_row: bool = True
    ) -> Any:
        """Gather `shard` (same numel on every rank) into `output` (world_size x shard), rank-major.
        `shard` may be this rank's row of `output` itself (in place: nothing is copied). With
        `fill_own_row=False` this rank's row of `output` may be left as it was: the caller reads
        its own part from `shard`, so nothing copies it (on gloo)."""
        self._count(Collective.ALL_GATHER, output.numel() * output.element_size(), 1.0)
        self.recent.append(f"All-Gather of {what}")
        rows = output.view(self.world_size, -1)
        source = shard.view(-1)
        if fill_own_row and shard.data_ptr() != rows[self.rank].data_ptr():
            rows[self.rank].copy_(source)
            source = rows[self.rank]
        if not self.distributed or (self.world_size == 1 and self.one_rank_shortcut):
            return None  # one rank: its row is the whole output
        try:
            shared = self._through_shared(output, output.numel() * output.element_size())
            if shared is not None:
                start = time.perf_counter()
                shared.all_gather(rows, source, fill_own_row=fill_own_row)
                if async_op:  # synchronous (shm.py): the step is blocked here, not later in `wait`
                    self.stats.gather_wait_s += time.perf_counter() - start
                return None
            if self._in_place(output):
                work = Works([
                    dist.broadcast(source if r == self.rank else rows[r], src=self._global[r], group=self.group,
                                   async_op=True)
                    for r in range(self.world_size)
                ])  # fmt: skip
            else:
                work = dist.all_gather_single(output.view(-1), source, group=self.group, async_op=True)
            if not async_op:
                work.wait()
                return None
            return work
        except RuntimeError as err:
            raise self.failed("All-Gather", what, err) from err

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, *, what: str, async_op: bool = False) -> Any:
        """Sum `full` (world_size x chunk, rank-major) over ranks; this rank keeps its chunk in
        `output`. `full` must not change until the returned work is waited for."""
        self._count(Collective.REDUCE_SCATTER, full.numel() * full.element_size(), 1.0)
        self.recent.append(f"Reduce-Scatter of {what}")
        rows = full.view(self.world_size, -1)
        if not self.distributed or (self.world_size == 1 and self.one_rank_shortcut):
            output.view(-1).copy_(rows[0])  # one rank: nothing to sum
            return None
        try:
            shared = self._through_shared(full, self.world_size * full.numel() * full.element_size())
            if shared is not None:
                shared.reduce_scatter(output.view(-1), rows)
                return None  # synchronous (shm.py, Note: shared-memory transport)
            if self._in_place(full):
                work = self._send_recv_reduce_scatter(output, rows)
            else:
                work = dist.reduce_scatter_single(output.view(-1), full.reshape(-1), group=self.group, async_op=True)
            if not async_op:
                work.wait()
                return None
            return work
        except RuntimeError as err:
            raise self.failed("Reduce-Scatter", what, err) from err

    def _send_recv_reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> Works:
        """Reduce-Scatter from point-to-point calls (Note: gloo): row j goes to rank j, the
        other ranks' rows for this rank arrive in a pooled buffer; the wait sums them."""
        n, me = self.world_size, self.rank
        chunk = rows.shape[1]
        received = self.pool.take((n - 1) * chunk, rows.dtype, rows.device).view(n - 1, chunk)
        peers = [r for r in range(n) if r != me]
        works = [dist.irecv(received[i], src=self._global[r], group=self.group) for i, r in enumerate(peers)]
        works += [dist.isend(rows[r], dst=self._global[r], group=self.group) for r in peers]

        def add_up() -> None:
            # Rank order, so the rounding does not depend on which rank sums.
            parts = [rows[me] if r == me else received[r if r < me else r - 1] for r in range(n)]
            flat = output.view(-1)
            torch.add(parts[0], parts[1], out=flat)  # one pass, not a copy then an add
            for part in parts[2:]:
                flat.add_(part)
            self.pool.give(received.view(-1))

        return Works(works, then=add_up)

    def all_reduce(self, tensor: torch.Tensor, *, what: str, op: str = "sum", async_op: bool = False) -> Any:
        """Reduce `tensor` over ranks in place (`op`: "sum" or "max"); with `async_op`, return
        the work to wait for."""
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
        self._count(Collective.BROADCAST, tensor.numel() * tensor.element_size(), 1.0)
        if not self.distributed:
            return
        try:
            dist.broadcast(tensor, src=self._global_rank(src), group=self.group)
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

    def wait(self, work: Any) -> None:
        """Wait on an async All-Gather, charging the blocked time to `gather_wait_s`."""
        if work is None:
            return
        start = time.perf_counter()
        work.wait()
        self.stats.gather_wait_s += time.perf_counter() - start


class Works:
    """Several works waited for as one, then an optional completion step."""

    def __init__(self, works: list[Any], then: Any = None) -> None:
        self.works = works
        self.then = then

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


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
    shard_group = replicate_group = None
    for start in range(0, world, shard_size):
        group = dist.new_group(list(range(start, start + shard_size)))
        if start <= rank < start + shard_size:
            shard_group = group
    for offset in range(shard_size):
        group = dist.new_group(list(range(offset, world, shard_size)))
        if rank % shard_size == offset:
            replicate_group = group
    return shard_group, replicate_group
