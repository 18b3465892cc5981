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

[Note: stream seam]
Every stream, event and stream wait of the engine goes through `stream_api(device)`: the module
giving `Stream`, `Event`, `current_stream`, `stream` and `current_device` for the device's type,
or None where program order suffices. Only "cuda" (`torch.cuda`) is registered; the tests
register a CPU stand-in for "cpu" (tests/support/cuda_standin.py) that records every wait and event and
checks each tensor read against them, so CUDA's ordering rules are tested on CPU through the
code a GPU runs, with no branch for tests. Pinned memory and the like still ask `device.type`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

Role = Literal["gather", "block", "reduce", "received", "slice"]


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
    def __init__(self) -> None:
        # (role, numel, dtype, device) -> free buffers, each with the event after its last use.
        self._free: dict[tuple[Role, int, torch.dtype, torch.device], list[tuple[torch.Tensor, Any]]] = {}

    def take(self, role: Role, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of undefined contents, ready for the current stream."""
        device = indexed(device)
        free = self._free.get((role, numel, dtype, device))
        if free:
            buffer, released = free.pop()
            if released is not None:
                stream_api(device).current_stream(device).wait_event(released)
            return buffer
        # Never an inference tensor (calls.py, Note: inference mode); leaving inference mode
        # enables grad, hence no_grad.
        with torch.inference_mode(False), torch.no_grad():
            return torch.empty(numel, dtype=dtype, device=device)

    def give(self, role: Role, buffer: torch.Tensor) -> None:
        """Return a buffer once the current stream has waited for every use of it."""
        released = current_event(buffer.device) if stream_api(buffer.device) is not None else None
        self._free.setdefault((role, buffer.numel(), buffer.dtype, buffer.device), []).append((buffer, released))

    def clear(self) -> None:
        self._free.clear()

    @property
    def cached_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for free in self._free.values() for b, _ in free)
