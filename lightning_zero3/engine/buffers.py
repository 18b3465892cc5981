"""`BufferPool`: reuse of the large transient buffers of gathers and reductions. Allocated anew
each time they fragment the C heap and memory grows step after step; units mostly share sizes,
so a pool keyed by (role, size class, dtype, device) keeps as many of each as were in use at once.

[Note: size classes]
A request for n elements falls in the class of n rounded up to the next of 8 sizes per power of two
(`size_class`); a buffer is made with the most elements asked of its class so far and handed out
narrowed to exactly n (`buffer[:n]`), so units of sizes within 1/8 of each other share buffers.
(docs/design.md, size classes)

[Note: what the pool keeps]
What a training step used at once, per role and class: the step's own peak (docs/accounting.md, Buffers
a step holds). (docs/design.md, what the pool keeps)

[Note: buffer roles and streams]
A buffer serves one role for life, each role one stream (comm.py, Note: streams), so a buffer
never moves to a stream its role does not use, whatever sizes coincide:
"gather" (receive rows) is taken on copy-in and given back on the compute stream after the
gather stream wrote it; "block" (whole parameters) lives on the compute stream; "reduce" is filled
and given back there, read by the reduce stream; "slice" (reshard.py) lives on copy-in;
"received" (transport.py, gloo) is CPU only; "packed" (comm.py, quantized rows) is taken on the
gather, reduce or replicate stream and given back where the work is waited for.
`give` records an event once the giving stream has waited for every use; `take` makes the
taker's stream wait for it, and so does the stream that allocated a buffer before the pool lets it
go (the caching allocator reuses it there). On CPU program order suffices.

[Note: stream seam]
Every stream, event and stream wait of the engine goes through `stream_api(device)`: the module giving
`Stream`, `Event`, `current_stream`, `stream` and `current_device` for the device's type, or None where
program order suffices. (docs/design.md, stream seam)
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

Role = Literal["gather", "block", "reduce", "received", "slice", "packed"]
_Key = tuple[Role, int, torch.dtype, torch.device]  # (role, size class, dtype, device)

CLASSES_PER_DOUBLING = 8  # Note: size classes


def size_class(numel: int) -> int:
    """The class of a request for `numel` elements: the next of 8 sizes per power of two, so a
    buffer serves any request of its class at most 1/8 smaller (Note: size classes)."""
    step = max(1, (1 << max(numel.bit_length() - 1, 0)) // CLASSES_PER_DOUBLING)
    return -(-numel // step) * step


STREAM_APIS: dict[str, Any] = {"cuda": torch.cuda}  # device type -> its streams (Note: stream seam)


def stream_api(device: torch.device) -> Any:
    """The streams of `device` (Note: stream seam); None: none, program order suffices."""
    return STREAM_APIS.get(device.type)


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index ("cuda" -> "cuda:0" when GPU 0 is current): a tensor's device
    always has one, so a device kept as a key or compared with tensors' must have it too."""
    device = torch.device(device)
    api = stream_api(device)
    if device.index is None and api is not None:
        return torch.device(device.type, api.current_device())
    return device


def current_event(device: torch.device) -> Any:
    api = stream_api(device)
    event = api.Event()
    event.record(api.current_stream(device))
    return event


class BufferPool:
    """Free buffers by (role, size class, dtype, device), and the bytes it holds now and at most."""

    def __init__(self) -> None:
        # key -> free buffers (whole, 1-D), each with the event after its last use.
        self._free: dict[_Key, list[tuple[torch.Tensor, Any]]] = {}
        self._widest: dict[_Key, int] = {}  # the most elements asked in each class: new buffers get it
        self._made_on: dict[int, Any] = {}  # data_ptr -> the stream current at allocation (CUDA)
        self._transient: set[int] = set()  # data_ptrs made inside `transient`: not kept after it
        self._depth = 0  # `transient` blocks open
        self.cached_bytes = 0  # of the free buffers: whole size classes, not the elements last asked for
        self.taken_bytes = 0  # handed out, not given back
        self.peak_bytes = 0  # the most `cached_bytes + taken_bytes` since `reset_peak`

    def take(self, role: Role, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of exactly `numel` elements and undefined contents, ready for the current
        stream: a pooled one of its size class, narrowed where larger (Note: size classes)."""
        device = indexed(device)
        key = (role, size_class(numel), dtype, device)
        widest = self._widest[key] = max(self._widest.get(key, 0), numel)
        free = self._free.get(key, [])
        fits = [i for i, (b, _) in enumerate(free) if b.numel() >= numel]
        if fits:
            buffer, released = free.pop(min(fits, key=lambda i: free[i][0].numel()))
            self.cached_bytes -= _nbytes(buffer)
            if released is not None:
                stream_api(device).current_stream(device).wait_event(released)
        else:
            if free:  # smaller than this class's widest request: replaced by one of that size
                small, released = free.pop(0)
                self.cached_bytes -= _nbytes(small)
                self._drop(small, released)
            # Never an inference tensor (calls.py, Note: inference mode); leaving inference mode
            # enables grad, hence no_grad.
            with torch.inference_mode(False), torch.no_grad():
                buffer = torch.empty(widest, dtype=dtype, device=device)
            api = stream_api(device)
            if api is not None:
                self._made_on[buffer.data_ptr()] = api.current_stream(device)
            if self._depth:
                self._transient.add(buffer.data_ptr())
        self.taken_bytes += _nbytes(buffer)
        self.peak_bytes = max(self.peak_bytes, self.taken_bytes + self.cached_bytes)
        return buffer if buffer.numel() == numel else buffer[:numel]

    def give(self, role: Role, buffer: torch.Tensor) -> None:
        """Return what `take` gave (the buffer, a view of it, or a tensor over its storage) once
        the current stream has waited for every use of it."""
        whole = _whole(buffer)
        self.taken_bytes -= _nbytes(whole)
        released = current_event(whole.device) if stream_api(whole.device) is not None else None
        if not self._depth and whole.data_ptr() in self._transient:
            self._drop(whole, released)
            return
        key = (role, size_class(whole.numel()), whole.dtype, indexed(whole.device))  # as `take`'s: a CPU stand-in's too
        self._free.setdefault(key, []).append((whole, released))
        self.cached_bytes += _nbytes(whole)

    @contextmanager
    def transient(self) -> Iterator[None]:
        """Buffers made inside are reused inside and go back to the allocator when the outermost
        block ends (or, if still taken then, when given back): a whole-weights call leaves the
        pool as it found it (Note: what the pool keeps)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.empty(lambda ptr: ptr in self._transient)

    def empty(self, which: Callable[[int], bool] | None = None, *, role: Role | None = None) -> None:
        """Give the free buffers back to the allocator: all, those of `role`, or those whose
        data_ptr `which` picks. Buffers taken stay taken."""
        on_host = False
        for key, free in self._free.items():
            if role is not None and key[0] != role:
                continue
            picked = [which is None or which(buffer.data_ptr()) for buffer, _ in free]
            for (buffer, released), drop in zip(free, picked):
                if drop:
                    self.cached_bytes -= _nbytes(buffer)
                    self._drop(buffer, released)
                    on_host = on_host or buffer.device.type == "cpu"
            free[:] = [entry for entry, drop in zip(free, picked) if not drop]
        self._free = {key: free for key, free in self._free.items() if free}
        if on_host:  # else the heap keeps the pages (RSS stays)
            release_freed_heap()

    def bytes(self) -> dict[str, int]:
        """ "pooled" (free), "taken" (handed out) and "peak" (the most of both at once since `reset_peak`)."""
        return {"pooled": self.cached_bytes, "taken": self.taken_bytes, "peak": self.peak_bytes}

    def reset_peak(self) -> None:
        self.peak_bytes = self.taken_bytes + self.cached_bytes

    def _drop(self, buffer: torch.Tensor, released: Any) -> None:
        """Let a free buffer go. On CUDA the caching allocator hands its memory to the next
        allocation on the stream that allocated it, so that stream first waits for its last
        use (no `record_stream`, no host wait)."""
        made_on = self._made_on.pop(buffer.data_ptr(), None)
        self._transient.discard(buffer.data_ptr())
        if released is not None and made_on is not None:
            made_on.wait_event(released)


def release_freed_heap() -> None:
    """glibc's `malloc_trim`: glibc keeps freed blocks below its rising mmap threshold in its heap
    (the pool's buffers let go on CPU, disk.py's moved optimizer state). Measured on the 20m GPT,
    2 ranks: RssAnon 43 MiB lower of 73 (docs/accounting.md, Offload)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.untyped_storage().nbytes()


def _whole(buffer: torch.Tensor) -> torch.Tensor:
    """The whole 1-D buffer over `buffer`'s storage (`buffer` may be narrowed, reshaped, or a new
    tensor over the storage, as unit.py's blocks are)."""
    storage = buffer.untyped_storage()
    numel = storage.nbytes() // buffer.element_size()
    if buffer.numel() == numel and buffer.storage_offset() == 0 and buffer.dim() == 1:
        return buffer
    with torch.inference_mode(False), torch.no_grad():
        return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(storage, 0, (numel,), (1,))
