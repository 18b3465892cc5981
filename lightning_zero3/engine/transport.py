"""How a process group moves the rows of an All-Gather and a Reduce-Scatter, chosen once per
group by `Comm`: `Local` (one rank), `NativeCollectives` (torch's own, for NCCL; tests run it
on gloo too), `GlooInPlace` (CPU tensors under gloo). A transport knows rows and ranks, never
units; `Comm` counts around it.

[Note: gloo]
gloo's All-Gather receives into a temporary buffer and copies it out; its Reduce-Scatter clones
the input and All-Reduces it (twice the bytes). Here the All-Gather is one in-place broadcast per
rank, the Reduce-Scatter send/recv of rows summed in rank order: each rank sends (N-1)/N of the
payload, as the ring would, and the step time drops (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_zero3.engine.buffers import BufferPool


class Transport(Protocol):
    def all_gather(self, rows: torch.Tensor) -> Any:
        """Fill every row of `rows` (world_size x chunk) from its rank; a work, or None when done."""

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> Any:
        """Sum `rows` over ranks into this rank's `output`; `rows` must not change until done."""

    def all_to_all(self, output: torch.Tensor, rows: torch.Tensor) -> Any:
        """Row j of `rows` to rank j, into row r of `output` from rank r (quantized reductions)."""


class Local:
    def all_gather(self, rows: torch.Tensor) -> None:
        return None

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> None:
        output.view(-1).copy_(rows[0])

    def all_to_all(self, output: torch.Tensor, rows: torch.Tensor) -> None:
        output.copy_(rows)


class NativeCollectives:
    def __init__(self, group: dist.ProcessGroup, *, rank: int) -> None:
        self.group = group
        self.rank = rank

    def all_gather(self, rows: torch.Tensor) -> Any:
        # In place: this rank's input is its row of the output.
        return dist.all_gather_single(rows.view(-1), rows[self.rank], group=self.group, async_op=True)

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> Any:
        return dist.reduce_scatter_single(output.view(-1), rows.reshape(-1), group=self.group, async_op=True)

    def all_to_all(self, output: torch.Tensor, rows: torch.Tensor) -> Any:
        return dist.all_to_all_single(output.view(-1), rows.view(-1), group=self.group, async_op=True)


class Works:
    def __init__(self, works: list[Any], then: Callable[[], None] | None = None) -> None:
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


class GlooInPlace:
    """Note: gloo."""

    def __init__(self, group: dist.ProcessGroup, *, rank: int, world_size: int, pool: BufferPool) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.pool = pool  # the rows received by the Reduce-Scatter
        self.peers = [dist.get_global_rank(group, r) for r in range(world_size)]

    def all_gather(self, rows: torch.Tensor) -> Works:
        return Works(
            [
                dist.broadcast(rows[r], src=self.peers[r], group=self.group, async_op=True)
                for r in range(self.world_size)
            ]
        )

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> Works:
        """Row j goes to rank j; the wait sums what arrives in rank order (rounding alike on every rank)."""
        n, me, chunk = self.world_size, self.rank, rows.shape[1]
        received = self.pool.take("received", (n - 1) * chunk, rows.dtype, rows.device).view(n - 1, chunk)
        others = [r for r in range(n) if r != me]
        works = [dist.irecv(received[i], src=self.peers[r], group=self.group) for i, r in enumerate(others)]
        works += [dist.isend(rows[r], dst=self.peers[r], group=self.group) for r in others]

        def add_up() -> None:
            parts = [rows[me] if r == me else received[r if r < me else r - 1] for r in range(n)]
            flat = output.view(-1)
            torch.add(parts[0], parts[1], out=flat)  # one pass, not a copy then an add
            for part in parts[2:]:
                flat.add_(part)
            self.pool.give("received", received.view(-1))

        return Works(works, then=add_up)

    all_to_all = NativeCollectives.all_to_all  # gloo's all-to-all takes CPU tensors as they are


__all__ = ["GlooInPlace", "Local", "NativeCollectives", "Transport"]
