"""Counting the operations that would read a device's memory on the host (each drains a GPU's
queue): `aten._local_scalar_dense` (`.item()`, `bool(t)`, `float(t)`, `int(t)`), `aten.is_nonzero`,
`aten.equal`, copies from a non-CPU device to the CPU, and `Tensor.tolist()` (which reads memory
without dispatching). On CPU nothing really syncs; tests/engine/test_engine_syncs.py says why it
matters."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


class HostReads(TorchDispatchMode):
    """Counts the operations that read a device's memory on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING:
            self.count += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            if source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu":
                self.count += 1
        return func(*args, **kwargs)


@contextmanager
def counting_host_reads() -> Iterator[HostReads]:
    mode = HostReads()
    original = torch.Tensor.tolist

    def tolist(self):
        mode.count += 1
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with mode:
            yield mode
    finally:
        torch.Tensor.tolist = original
