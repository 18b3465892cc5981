"""How a process group moves the rows of an All-Gather and a Reduce-Scatter: one small
interface, one implementation per file, chosen once per process group (`choose_transport`).

- `Local` (this file): one rank, or no torch.distributed: nothing to move.
- `NativeCollectives` (native.py): torch's own collectives; NCCL and every other backend.
- `GlooInPlace` (gloo.py): CPU tensors under gloo, built from in-place broadcasts and
  send/recv (gloo.py, Note: gloo).

A transport knows rows and ranks, never units; `Comm` (comm.py) counts the bytes and names
the collective around it.
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
        """Fill every row of `rows` (world_size x chunk) from its rank; this rank's row holds its
        input already. Asynchronous: returns a work to wait for, or None when done."""

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> Any:
        """Sum `rows` (world_size x chunk) over ranks into `output` (this rank's chunk).
        Asynchronous: returns a work to wait for, or None when done; `rows` must not change
        until then."""


class Local:
    """One rank: its row is the whole All-Gather, its row the whole sum."""

    def all_gather(self, rows: torch.Tensor) -> None:
        return None

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> None:
        output.view(-1).copy_(rows[0])


def choose_transport(
    group: dist.ProcessGroup | None,
    *,
    world_size: int,
    rank: int,
    pool: BufferPool,
    device_type: str = "cpu",
    one_rank_shortcut: bool = True,
) -> Transport:
    """The transport for collectives on `device_type` tensors over `group` (None: not distributed)."""
    if group is None or (world_size == 1 and one_rank_shortcut):
        return Local()
    if device_type == "cpu" and world_size > 1 and "gloo" in str(dist.get_backend(group)):
        return GlooInPlace(group, rank=rank, world_size=world_size, pool=pool)
    return NativeCollectives(group, rank=rank)


__all__ = ["Local", "Transport", "choose_transport"]
