"""`BufferPool`: reuse of the large transient buffers of gathers and reductions. Allocated anew
each time they fragment the C heap and memory grows step after step; units mostly share sizes,
so a pool keyed by (role, size, dtype, device) keeps as many of each as were in use at once.

[Note: buffer roles and streams]
A buffer serves one role for life, each role one stream (comm.py, Note: streams), so a buffer
never moves to a stream its role does not use, whatever sizes coincide:
"gather" (receive rows) is taken on copy-in and given back on the compute stream after the
gather stream wrote it; "block" (full parameters) lives on the compute stream; "reduce" is filled
and given back there, read by the reduce stream; "slice" (reshard.py) lives on copy-in;
"received" (transport.py, gloo) is CPU only.
`give` records an event once the giving stream has waited for every use; `take` makes the
taker's stream wait for it. On CPU program order suffices.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

Role = Literal["gather", "block", "reduce", "received", "slice"]


def current_event(device: torch.device) -> Any:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class BufferPool:
    def __init__(self) -> None:
        # (role, numel, dtype, device) -> free buffers, each with the event after its last use.
        self._free: dict[tuple[Role, int, torch.dtype, torch.device], list[tuple[torch.Tensor, Any]]] = {}

    def take(self, role: Role, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of undefined contents, ready for the current stream."""
        free = self._free.get((role, numel, dtype, device))
        if free:
            buffer, released = free.pop()
            if released is not None:
                torch.cuda.current_stream(device).wait_event(released)
            return buffer
        # Never an inference tensor (calls.py, Note: inference mode); leaving inference mode
        # enables grad, hence no_grad.
        with torch.inference_mode(False), torch.no_grad():
            return torch.empty(numel, dtype=dtype, device=device)

    def give(self, role: Role, buffer: torch.Tensor) -> None:
        """Return a buffer once the current stream has waited for every use of it."""
        released = current_event(buffer.device) if buffer.device.type == "cuda" else None
        self._free.setdefault((role, buffer.numel(), buffer.dtype, buffer.device), []).append((buffer, released))

    def clear(self) -> None:
        self._free.clear()

    @property
    def cached_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for free in self._free.values() for b, _ in free)
