"""`NativeCollectives`: torch's own All-Gather and Reduce-Scatter (transport.py), for NCCL;
tests run it on gloo too (tests/test_engine_invariants.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class NativeCollectives:
    def __init__(self, group: dist.ProcessGroup, *, rank: int) -> None:
        self.group = group
        self.rank = rank

    def all_gather(self, rows: torch.Tensor) -> Any:
        # In place: this rank's input is its row of the output.
        return dist.all_gather_single(rows.view(-1), rows[self.rank], group=self.group, async_op=True)

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> Any:
        return dist.reduce_scatter_single(output.view(-1), rows.reshape(-1), group=self.group, async_op=True)
