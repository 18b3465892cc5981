"""How a process group moves the rows of an All-Gather and a Reduce-Scatter, chosen once per
group: `Local` (one rank), `NativeCollectives` (native.py, torch's own), `GlooInPlace` (gloo.py,
CPU tensors under gloo). A transport knows rows and ranks, never units; `Comm` counts around it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_zero3.engine.buffers import BufferPool
from lightning_zero3.engine.gloo import GlooInPlace
from lightning_zero3.engine.native import NativeCollectives


class Transport(Protocol):
    def all_gather(self, rows: torch.Tensor) -> Any:
        """Fill every row of `rows` (world_size x chunk) from its rank; a work, or None when done."""

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> Any:
        """Sum `rows` over ranks into this rank's `output`; `rows` must not change until done."""


class Local:
    def all_gather(self, rows: torch.Tensor) -> None:
        return None

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> None:
        output.view(-1).copy_(rows[0])


def choose_transport(
    group: dist.ProcessGroup | None, *, world_size: int, rank: int, pool: BufferPool, device_type: str = "cpu",
    one_rank_shortcut: bool = True,
) -> Transport:  # fmt: skip
    if group is None or (world_size == 1 and one_rank_shortcut):
        return Local()
    if device_type == "cpu" and world_size > 1 and "gloo" in str(dist.get_backend(group)):
        return GlooInPlace(group, rank=rank, world_size=world_size, pool=pool)
    return NativeCollectives(group, rank=rank)


__all__ = ["Local", "Transport", "choose_transport"]
