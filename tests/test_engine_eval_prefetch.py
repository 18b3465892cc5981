"""Evaluation passes (no_grad, inference_mode) prefetch like training passes: while a unit
computes, the next unit of the recorded order is already being gathered."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from tests.models import MLP, mlp_batch
from tests.parity import local_slice
from tests.ranks import run_ranks


def _in_flight_while_each_block_runs(rank: int, world_size: int, mode: str) -> dict:
    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model, prefetch=1)
    x, y = mlp_batch(0)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    F.mse_loss(model(x), y).backward()  # records the order
    seen: dict[str, list[str]] = {}

    def note_in_flight(name: str, *_: object) -> None:
        seen[name] = [unit.name for unit in sharded.units if unit.gather_in_flight]

    for name, block in model.blocks.named_children():
        block.register_forward_hook(partial(note_in_flight, name))
    with {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]():
        out = model(x)
    sharded.check_tags()
    return {"seen": seen, "finite": bool(torch.isfinite(out).all())}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_evaluation_passes_prefetch_the_next_unit(mode):
    for result in run_ranks(_in_flight_while_each_block_runs, 2, mode):
        assert result["finite"]
        assert result["seen"] == {"0": ["blocks.1"], "1": ["blocks.2"], "2": []}, result["seen"]
