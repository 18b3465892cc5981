"""`BufferPool`: reuse of the large transient buffers of gathers and reductions.

Every All-Gather needs a receive buffer (the whole unit; this rank's row of it is the send
buffer), every Reduce-Scatter an input buffer as large as the unit's full gradient, and every
gather a block for the full parameters (unit.py, Note: full-parameter blocks). Allocating them
anew each time makes the C heap fragment and the process's memory grow step after step. Units
of a model mostly share sizes (identical blocks), so a pool keyed by (role, size, dtype,
device) keeps a handful of buffers: at most as many of each as were in use at once, i.e. the
1 + prefetch (+ reductions in flight) transient units the design allows.

[Note: buffer roles and streams]
A buffer serves one role for its whole life, and each role has one stream that takes it and
gives it back (comm.py, Note: streams), so a buffer never moves to a stream its role does not
use, whatever sizes coincide (in fp32 a unit's gather rows and Reduce-Scatter rows have the
same size; a block can match another unit's rows):
- "gather" (All-Gather receive buffer): taken on the copy-in stream, written by the collective
  on the gather stream, read by the copy-out and given back on the compute stream.
- "block" (full parameters): taken, emptied (`release`) and refilled on the compute stream.
- "reduce" (Reduce-Scatter input): taken and filled on the compute stream (reduce.py, Note:
  gradient copy-in), read by the collective on the reduce stream, given back on the compute
  stream after waiting for it.
- "slice" (the 1/G slice a unit keeps after forward, reshard.py): taken, filled, copied into
  the send row and given back on the copy-in stream.
- "received" (gloo's Reduce-Scatter receive rows, gloo.py): CPU only, program order.
`give` is called once the giving stream has waited for every use of the buffer; it records an
event there, and `take` makes the taker's current stream wait for it, so the next user never
overwrites memory still being read. On CPU there are no events: program order suffices.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

# What a buffer is for (Note: buffer roles and streams).
Role = Literal["gather", "block", "reduce", "received", "slice"]


def current_event(device: torch.device) -> Any:
    """A CUDA event recorded now on `device`'s current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class BufferPool:
    def __init__(self) -> None:
        # Free buffers per (role, numel, dtype, device), each with the event after its last use.
        self._free: dict[tuple[Role, int, torch.dtype, torch.device], list[tuple[torch.Tensor, Any]]] = {}

    def take(self, role: Role, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer for `role` (Note: buffer roles and streams) of `numel` elements with
        undefined contents, ready for the current stream."""
        free = self._free.get((role, numel, dtype, device))
        if free:
            buffer, released = free.pop()
            if released is not None:
                torch.cuda.current_stream(device).wait_event(released)
            return buffer
        # Never an inference tensor, which could not be updated in place outside inference mode
        # (calls.py, Note: inference mode); leaving inference mode enables grad, hence no_grad.
        with torch.inference_mode(False), torch.no_grad():
            return torch.empty(numel, dtype=dtype, device=device)

    def give(self, role: Role, buffer: torch.Tensor) -> None:
        """Return a buffer taken for `role` once the current stream has waited for every use of
        it (no collective or copy still reads or writes it elsewhere)."""
        released = current_event(buffer.device) if buffer.device.type == "cuda" else None
        self._free.setdefault((role, buffer.numel(), buffer.dtype, buffer.device), []).append((buffer, released))

    def clear(self) -> None:
        """Drop every free buffer (their memory goes back to the allocator)."""
        self._free.clear()

    @property
    def cached_bytes(self) -> int:
        """Bytes held by free buffers, waiting to be reused."""
        return sum(b.numel() * b.element_size() for free in self._free.values() for b, _ in free)
