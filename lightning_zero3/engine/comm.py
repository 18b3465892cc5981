"""The only module that runs torch.distributed collectives (groups.py makes the groups): over an
explicit process group, counting payload (the whole tensor a collective produces or consumes) and wire bytes (what one
rank sends with the ring algorithm: (N-1)/N of the payload, 2(N-1)/N for All-Reduce).

[Note: streams]
On CUDA communication runs beside the compute, as in FSDP2: a gather's copy-in runs on a copy-in stream
that first waits for the compute stream (the optimizer may just have written the shards); the All-Gather
is issued from a gather stream after the copy-in's event; a Reduce-Scatter is issued on a reduce stream
that waits for the compute stream. (docs/design.md, streams)

[Note: collective device]
A `Comm` built with `device` takes tensors of that device type only, on every backend: NCCL has
no path for CPU tensors (an error or a crash), and gloo, which takes both, would hide such a call
in every CPU test. Callers holding state elsewhere (e.g. optimizer state a user moved to the host)
copy it to `device` first (state.py).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero3.engine.buffers import BufferPool, current_event, indexed, stream_api
from lightning_zero3.engine.config import Quantization
from lightning_zero3.engine.groups import let_go_at_exit
from lightning_zero3.engine.quantize import KeptPacked, RowCodec, pack_all_reduce, pack_gather, pack_reduce
from lightning_zero3.engine.transport import GlooInPlace, Local, NativeCollectives, Transport


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
    # Seconds blocked waiting for All-Gathers (what prefetch failed to hide): the host's on CPU; on
    # CUDA the compute stream's, timed by events: read once passed, the rest by
    # `last_step_gather_wait_s` (a sync).
    gather_wait_s: float = 0.0
    _last_host_s: float = 0.0
    waits: deque[tuple[Any, Any]] = field(default_factory=deque)  # (start, end) CUDA events in flight
    _last_waits: deque[tuple[Any, Any]] = field(default_factory=deque)

    def add_wait(self, start: Any, end: Any) -> None:
        """Time a wait by its events; those already passed are folded into `gather_wait_s` without
        waiting, so loops that never call `end_step` (evaluation, plain loops) keep only the
        events of the work in flight."""
        self.waits.append((start, end))
        while self.waits and self.waits[0][1].query():
            done, passed = self.waits.popleft()
            self.gather_wait_s += done.elapsed_time(passed) / 1e3

    def end_step(self) -> None:
        self.last_step = dict(self.current)
        self.current = defaultdict(CollectiveBytes)
        self._last_host_s, self._last_waits = self.gather_wait_s, self.waits
        self.gather_wait_s, self.waits = 0.0, deque()

    @property
    def last_step_gather_wait_s(self) -> float:
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
    """Note: streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.api = stream_api(device)  # buffers.py, Note: stream seam
        self.enabled = self.api is not None
        # High priority, as FSDP2's: communication is what the compute waits for.
        names = ("copy_in", "gather", "reduce", "replicate") if self.enabled else ()
        self._streams: dict[str, Any] = {name: self.api.Stream(device, priority=-1) for name in names}

    @contextmanager
    def on(self, name: str | None, *, after: Any = None, wait_current: bool | None = None) -> Iterator[None]:
        """Run the block on stream `name` (None: the current one), which first waits for the
        current stream (by default all but "gather") and for `after`."""
        if not self.enabled or name is None:
            yield
            return
        stream = self._streams[name]
        if wait_current if wait_current is not None else name != "gather":
            stream.wait_stream(self.api.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with self.api.stream(stream):
            yield

    def event(self) -> Any:  # None on CPU
        return current_event(self.device) if self.enabled else None

    def wait_for(self, event: Any) -> None:  # the current stream waits, not the host
        if event is not None:
            self.api.current_stream(self.device).wait_event(event)


class Comm:
    """Collectives over one process group; without torch.distributed, local copies."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        pool: BufferPool | None = None,
        device: torch.device | None = None,
        stats: CommStats | None = None,
        quantization: Quantization | None = None,
    ) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.stats = stats if stats is not None else CommStats()  # shared by Comms counted together
        self.pool = pool or BufferPool()  # gloo's receive rows
        self.device = device  # Note: collective device; None: any
        self.quantization = quantization or Quantization()  # quantize.py, Note: quantized collectives
        self._device_type = device.type if device is not None else "cpu"
        # One rank: local copies; benchmarks/gpu_check.py turns it off to run NCCL at world size 1.
        self._one_rank_shortcut = True
        self.transport = self._choose()
        self._streams: dict[torch.device, Streams] = {}
        # For the message of a failed collective: the last ones issued, and the recorded order.
        self.recent: deque[str] = deque(maxlen=6)
        self.describe_step: Callable[[], str] | None = None
        if self.distributed:
            let_go_at_exit(self)  # groups.py, Note: leaving at exit

    def release(self) -> None:
        """Let go of the process group (groups.py, Note: leaving at exit); a collective afterwards fails."""
        self.group, self.transport = None, _Left()

    def _choose(self) -> Transport:
        if not self.distributed or (self.world_size == 1 and self._one_rank_shortcut):
            return Local()
        assert self.group is not None
        if self._device_type == "cpu" and self.world_size > 1 and "gloo" in str(dist.get_backend(self.group)):
            return GlooInPlace(self.group, rank=self.rank, world_size=self.world_size, pool=self.pool)
        return NativeCollectives(self.group, rank=self.rank)

    @property
    def one_rank_shortcut(self) -> bool:
        return self._one_rank_shortcut

    @one_rank_shortcut.setter
    def one_rank_shortcut(self, value: bool) -> None:
        self._one_rank_shortcut = value
        self.transport = self._choose()

    def streams(self, device: torch.device) -> Streams:
        device = indexed(device)  # one set of streams per device, however it is named
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = Streams(device)
        return streams

    def failed(self, collective: str, what: str, err: BaseException) -> CollectiveError:
        """The error for a failed collective, naming the usual suspects."""
        recent = ", ".join(self.recent) or "none"
        step = f" {self.describe_step()}." if self.describe_step is not None else ""
        return CollectiveError(
            f"{collective} of {what} failed on rank {self.rank}: {err}. This rank's last collectives, "
            f"oldest first: {recent}.{step}{COLLECTIVE_HINT}"
        )

    def _count(
        self,
        collective: str,
        what: str,
        payload: torch.Tensor,
        ring: float,
        *others: torch.Tensor,
        sent: int | None = None,
    ) -> None:
        """Check the tensors' device (Note: collective device), count the bytes under "all_gather", ...
        (wire: `sent` elements if given, else the ring's share) and note the collective in `recent`."""
        for tensor in (payload, *others):
            if self.device is not None and tensor.device.type != self.device.type:
                raise CollectiveError(
                    f"{collective} of {what}: a tensor on {tensor.device}, but this process group's collectives "
                    f"take {self.device.type} tensors ({self.device}). NCCL takes CUDA tensors only and fails "
                    f"or crashes on others. This is a lightning_zero3 bug: the caller must copy the tensor to "
                    f"{self.device} first; please report it."
                )
        n, nbytes = self.world_size, payload.numel() * payload.element_size()
        key = collective.lower().replace("-", "_")
        wire = sent * payload.element_size() if sent is not None else int(round(ring * (n - 1) / n * nbytes))
        self.stats.current[key].add(nbytes, wire)
        self.recent.append(f"{collective} of {what}")

    def codec(self, kind: str, *, width: int, itemsize: int, data: int | None) -> RowCodec | None:
        """How rows of `kind` ("weights", "gradients") are packed (quantize.py); None: sent as they are."""
        bits = self.quantization.bits(kind)
        if not bits or data is None or isinstance(self.transport, Local):
            return None
        return RowCodec(width=width, data=data, itemsize=itemsize, block=self.quantization.block, bits=bits)

    def all_gather(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        *,
        async_op: bool,
        what: str,
        quantize_data: int | None = None,
        kept: tuple[KeptPacked, object] | None = None,
    ) -> Any:
        """Gather `shard` into `output` (world_size x shard); `shard` may be this rank's row. The
        first `quantize_data` elements of each row may travel quantized (quantize_weights), this
        rank's packed through `kept` (quantize.py, Note: packed once per change)."""
        rows = output.view(self.world_size, -1)
        if shard.data_ptr() != rows[self.rank].data_ptr():
            rows[self.rank].copy_(shard.view(-1))
        codec = self.codec("weights", width=rows.shape[1], itemsize=rows.element_size(), data=quantize_data)
        plain = (output, lambda t: t.all_gather(rows))
        sent, issue = plain if codec is None else pack_gather(rows, self.rank, codec, self.pool, kept)
        self._count("All-Gather", what, sent, 1.0, output)
        return self._run("All-Gather", what, lambda: issue(self.transport), async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        whole: torch.Tensor,
        *,
        what: str,
        async_op: bool = False,
        quantize_data: int | None = None,
    ) -> Any:
        """Sum `whole` (world_size x chunk) over ranks into this rank's `output`; `whole` must not
        change until the work is waited for. The first `quantize_data` elements of each row may
        travel quantized (quantize_gradients), and then `whole` is overwritten."""
        rows = whole.view(self.world_size, -1)
        codec = self.codec("gradients", width=rows.shape[1], itemsize=rows.element_size(), data=quantize_data)
        plain = (whole, lambda t: t.reduce_scatter(output, rows))
        sent, issue = plain if codec is None else pack_reduce(output, rows, codec, self.pool)
        self._count("Reduce-Scatter", what, sent, 1.0, output)
        return self._run("Reduce-Scatter", what, lambda: issue(self.transport), async_op)

    def _run(self, collective: str, what: str, issue: Callable[[], Any], async_op: bool) -> Any:
        try:
            work = issue()
            if work is not None and not async_op:
                work.wait()
                return None
            return work
        except RuntimeError as err:
            raise self.failed(collective, what, err) from err

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        what: str,
        op: str = "sum",
        async_op: bool = False,
        quantize_data: int | None = None,
    ) -> Any:
        """Reduce 1-D `tensor` over ranks in place (`op`: "sum" or "max"); a sum's first
        `quantize_data` elements may travel quantized (quantize_gradients): an All-Gather of packed rows."""
        codec = self.codec("gradients", width=tensor.numel(), itemsize=tensor.element_size(), data=quantize_data)
        if codec is not None and op == "sum":
            sent, packed = pack_all_reduce(tensor, self.rank, self.world_size, codec, self.pool)
            self._count("All-Gather", what, sent, 1.0, tensor)
            return self._run("All-Reduce", what, lambda: packed(self.transport), async_op)
        self._count("All-Reduce", what, tensor, 2.0)
        if not self.distributed:
            return None
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        issue = lambda: dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=async_op)
        return self._run("All-Reduce", what, issue, async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        output_splits: list[int],
        input_splits: list[int],
        what: str,
        payload_is_output: bool = False,
    ) -> None:
        """Send `input_splits[r]` elements of 1-D `input` (in rank order) to rank r and receive
        `output_splits[r]` from rank r into `output`; the payload is `input` (or `output`), the
        wire what leaves this rank."""
        payload, other = (output, input) if payload_is_output else (input, output)
        self._count("All-to-All", what, payload, 1.0, other, sent=input.numel() - input_splits[self.rank])
        if self.world_size == 1:
            output.copy_(input)
            return
        issue = lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group)
        self._run("All-to-All", what, issue, False)

    def broadcast(self, tensor: torch.Tensor, *, src: int, what: str) -> None:
        self._count("Broadcast", what, tensor, 1.0)
        if self.distributed:
            assert self.group is not None
            source = dist.get_global_rank(self.group, src)
            self._run("Broadcast", what, lambda: dist.broadcast(tensor, src=source, group=self.group), False)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`; for rare control messages only."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        self.stats.current["object"].add(0, 0)  # control messages, never on the per-step path
        return out

    def wait(self, work: Any, device: torch.device | None = None) -> None:
        """Wait on an All-Gather, charging the time blocked to `gather_wait_s` (events on CUDA)."""
        if work is None:
            return
        api = stream_api(device) if device is not None else None
        if api is not None:
            start, end = (api.Event(enable_timing=True) for _ in range(2))
            start.record(api.current_stream(device))
            work.wait()
            end.record(api.current_stream(device))
            self.stats.add_wait(start, end)
            return
        start_s = time.perf_counter()
        work.wait()
        self.stats.gather_wait_s += time.perf_counter() - start_s


class _Left:
    def all_gather(self, *tensors: torch.Tensor) -> Any:
        raise CollectiveError("this process group was left at exit (engine/groups.py, Note: leaving at exit)")

    reduce_scatter = all_to_all = all_gather
