"""A CPU stand-in for CUDA's ordering rules, so the engine's stream code is tested without a GPU.

`standin()` registers `FakeCuda` as the streams of "cpu" (engine/buffers.py, Note: stream seam):
the engine then runs its CUDA code path (side streams, events, stream waits, timing events) on
CPU tensors. A `TorchDispatchMode` meanwhile

- keeps, per storage, the (fake) stream and clock of its last write and of its reads since, and
  records a race when an access on one stream is not ordered after a conflicting one on another
  by `wait_stream`/`wait_event`/a host sync: what `torch.cuda._sanitizer` checks on a GPU, with
  the same vector clocks;
- counts the host waits (`synchronize` of a stream or an event), allocations and copies (of them
  the non-blocking ones), and the host<->device value transfers a GPU would make: reads of device memory on the host
  (`aten._local_scalar_dense`, `is_nonzero`, `equal`, `Tensor.tolist()`), Python values written
  into tensors (`aten.lift_fresh`: `t[i] = 3`, `torch.tensor(...)`) and `Tensor.to(device)` calls
  ("moves", of 0-dim tensors also "scalar_moves"): a copy on a GPU when the devices differ, here
  counted whatever they are, since on CPU they never differ;
- records the devices of every collective's tensors.

Collectives are modelled as NCCL's: they read and write their tensors on the stream current when
issued, so a consumer must wait for an event recorded after the issue (comm.py, Note: streams).
Limits: `work.wait()` itself orders nothing here, so a missing work wait is not caught (gloo waits
on the host anyway); gloo's Reduce-Scatter sums at the wait (transport.py), on the waiting stream.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_zero3.engine import buffers

Clock = dict[int, int]  # stream id -> the last of its operations known to have happened


def _merge(into: Clock, other: Clock) -> None:
    for stream, tick in other.items():
        if into.get(stream, 0) < tick:
            into[stream] = tick


class FakeStream:
    def __init__(self, api: FakeCuda, name: str) -> None:
        self.api, self.id, self.name = api, len(api.streams), name
        self.clock: Clock = {self.id: 0}
        api.streams.append(self)

    def tick(self) -> int:
        """An operation enqueued on this stream: after everything the host has waited for."""
        _merge(self.clock, self.api.host)
        self.clock[self.id] += 1
        return self.clock[self.id]

    def wait_stream(self, other: FakeStream) -> None:
        self.api.edges.append(("wait_stream", self.name, other.name))
        _merge(self.clock, other.clock)

    def wait_event(self, event: FakeEvent) -> None:
        self.api.edges.append(("wait_event", self.name, event.stream.name if event.stream else "<unrecorded>"))
        _merge(self.clock, event.clock)

    def synchronize(self) -> None:
        self.api.host_waits["stream.synchronize"] += 1
        self.api.host_sync(self.clock)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, api: FakeCuda, enable_timing: bool = False) -> None:
        self.api, self.clock, self.stream = api, Clock(), None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.api.current
        self.api.edges.append(("record", stream.name, ""))
        self.stream, self.clock = stream, dict(stream.clock)

    def query(self) -> bool:  # CPU work is done once issued
        self.api.host_sync(self.clock)
        return True

    def synchronize(self) -> None:
        self.api.host_waits["event.synchronize"] += 1
        self.api.host_sync(self.clock)

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeCuda:
    """What the engine uses of `torch.cuda`, for CPU tensors (engine/buffers.py, Note: stream seam)."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.host: Clock = {}  # what the host has waited for
        self.edges: list[tuple[str, str, str]] = []
        self.host_waits: Counter[str] = Counter()  # "stream.synchronize", "event.synchronize"
        self.current = FakeStream(self, "default")

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch.cuda's name
        caller = sys._getframe(1).f_locals  # Streams names its streams in a comprehension: take the name
        return FakeStream(self, str(caller.get("name", f"side{len(self.streams)}")))

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self, enable_timing)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    def current_device(self) -> int:
        return 0

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def host_sync(self, clock: Clock) -> None:
        _merge(self.host, clock)


@dataclass
class _Access:
    write: tuple[FakeStream, int] | None = None
    reads: dict[int, tuple[FakeStream, int]] = field(default_factory=dict)  # stream id -> its last read


# Ops that touch no data: views, metadata, allocation of undefined contents.
_NO_DATA = {"set_", "resize_", "_swap_data_ptr_", "detach", "alias", "lift_fresh"}
_FRESH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal"}


class StandIn(TorchDispatchMode):
    """The dispatch mode of `standin()`: orders, counts, collective devices."""

    def __init__(self, api: FakeCuda) -> None:
        super().__init__()
        self.api = api
        self.races: list[str] = []
        # "host_reads", "host_writes", "moves", "scalar_moves"; "allocations" (`empty*` of elements), "copies"
        # (`copy_`) and of them "non_blocking_copies".
        self.counts: Counter[str] = Counter()
        self.collectives: list[tuple[str, tuple[str, ...]]] = []  # (op, devices of its tensors)
        self._storages: dict[int, _Access] = {}

    # ---- ordering ------------------------------------------------------------------------------
    def _access(self, tensor: torch.Tensor, *, write: bool, what: str) -> None:
        if tensor.device.type != "cpu" or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        stream = self.api.current
        tick = stream.clock[stream.id]
        access = self._storages.setdefault(storage.data_ptr(), _Access())
        earlier = [access.write] if access.write is not None else []
        if write:
            earlier += list(access.reads.values())
        for other, when in earlier:
            if other is not stream and stream.clock.get(other.id, 0) < when:
                kind = "write" if write else "read"
                self.races.append(
                    f"{what}: {kind} on {stream.name} of a tensor {tuple(tensor.shape)} {tensor.dtype} last "
                    f"accessed on {other.name} with no wait for it"
                )
        if write:
            access.write, access.reads = (stream, tick), {}
        else:
            access.reads[stream.id] = (stream, tick)

    def read_on_host(self, tensor: torch.Tensor, what: str) -> None:
        """A device-to-host read: enqueued on the current stream, then the host waits for it."""
        self.counts["host_reads"] += 1
        self.api.current.tick()
        self._access(tensor, write=False, what=what)
        self.api.host_sync(self.api.current.clock)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        namespace = func.namespace
        if name in HOST_READS:
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    self.read_on_host(arg, name)
            return func(*args, **kwargs)
        if name == "lift_fresh":  # a tensor just made from a Python value, outside dispatch
            self.counts["host_writes"] += 1
            # Its storage is new: the history kept at that address is a freed tensor's (a false race).
            self._storages.pop(args[0].untyped_storage().data_ptr(), None)
        if name == "copy_":
            self.counts["copies"] += 1
            self.counts["non_blocking_copies"] += bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        if namespace == "c10d":
            devices = tuple(t.device.type for t in _tensors(args, kwargs))
            self.collectives.append((name, devices))
        out = func(*args, **kwargs)
        if name in _FRESH:  # memory allocated, not a 0-element tensor `set_` points elsewhere
            self.counts["allocations"] += any(t.numel() > 0 for t in _tensors([out], {}))
        if name in _NO_DATA or (namespace == "aten" and func.is_view):
            return out
        self.api.current.tick()
        schema = func._schema
        written = set()
        for arg, value in zip(schema.arguments, [*args, *[kwargs.get(a.name) for a in schema.arguments[len(args) :]]]):
            mutable = arg.alias_info is not None and arg.alias_info.is_write
            for tensor in _tensors([value], {}):
                self._access(tensor, write=False, what=str(func))
                if mutable:
                    self._access(tensor, write=True, what=str(func))
                    written.add(id(tensor))
        fresh = all(ret.alias_info is None for ret in schema.returns)  # new storage: its history is another's
        for tensor in _tensors([out], {}):
            if id(tensor) in written:
                continue
            if fresh and tensor.device.type == "cpu":
                self._storages.pop(tensor.untyped_storage().data_ptr(), None)
            if name not in _FRESH:
                self._access(tensor, write=True, what=str(func))
        return out


def _tensors(args: Any, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors(value, {}))
    return found


@contextmanager
def _patched(mode: StandIn) -> Iterator[None]:
    """`Tensor.tolist` (reads memory without dispatching) and `Tensor.to` (a same-device move
    dispatches nothing) counted."""
    tolist, to = torch.Tensor.tolist, torch.Tensor.to

    def counted_tolist(self: torch.Tensor) -> Any:
        mode.read_on_host(self, "tolist")
        return tolist(self)

    def counted_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs or (args and isinstance(args[0], (torch.device, str, int))):
            mode.counts["moves"] += 1
            mode.counts["scalar_moves"] += self.dim() == 0
        return to(self, *args, **kwargs)

    torch.Tensor.tolist, torch.Tensor.to = counted_tolist, counted_to  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.to = tolist, to  # type: ignore[method-assign]


@contextmanager
def standin(*, as_cuda: bool = False) -> Iterator[StandIn]:
    """CUDA's streams and ordering rules for CPU tensors inside the block (the engine must be
    built inside it: `Streams` choose at construction). `as_cuda` also registers the fake for
    "cuda" (device normalisation without a GPU)."""
    api = FakeCuda()
    types = ["cpu", "cuda"] if as_cuda else ["cpu"]
    saved = {t: buffers.STREAM_APIS.get(t) for t in types}
    mode = StandIn(api)
    for t in types:
        buffers.STREAM_APIS[t] = api
    try:
        with _patched(mode), mode:
            yield mode
    finally:
        for t, saved_api in saved.items():
            if saved_api is None:
                buffers.STREAM_APIS.pop(t, None)
            else:
                buffers.STREAM_APIS[t] = saved_api


@contextmanager
def counting() -> Iterator[StandIn]:
    """The counts only, with no streams (a plain model, DDP): the same mode, no fake registered."""
    mode = StandIn(FakeCuda())
    with _patched(mode), mode:
        yield mode
