"""Evaluation passes (no_grad, inference_mode) prefetch like training passes: while a unit
computes, the next unit of the recorded order is already being gathered."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks


def _in_flight_while_each_block_runs(rank: int, world_size: int, mode: str) -> dict:
    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model, prefetch=1)
    x, y = mlp_batch(0)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    F.mse_loss(model(x), y).backward()  # records the order
    seen: dict[str, list[str]] = {}

    def note_in_flight(name: str, *_: object) -> None:
        seen[name] = [unit.name for unit in sharded._units if unit.gather_in_flight]

    for name, block in model.blocks.named_children():
        block.register_forward_hook(partial(note_in_flight, name))
    with {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]():
        out = model(x)
    sharded._checks.check()
    return {"seen": seen, "finite": bool(torch.isfinite(out).all())}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_evaluation_passes_prefetch_the_next_unit(mode):
    for result in run_ranks(_in_flight_while_each_block_runs, 2, mode):
        assert result["finite"]
        assert result["seen"] == {"0": ["blocks.1"], "1": ["blocks.2"], "2": []}, result["seen"]


def _evaluation_before_training(rank: int, world_size: int) -> dict:
    """Three evaluation passes of a fresh 4-unit model (root + 3 blocks): what was in flight
    while each block ran, and the host reads of each pass (issue 22, item 4)."""
    from tests.support.host_reads import counting_host_reads

    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model, prefetch=1)
    x = local_slice(mlp_batch(0)[0], rank, world_size)
    seen: list[dict[str, list[str]]] = []

    def note_in_flight(name: str, *_: object) -> None:
        seen[-1][name] = [unit.name for unit in sharded._units if unit.gather_in_flight]

    for name, block in model.blocks.named_children():
        block.register_forward_pre_hook(partial(note_in_flight, name))
    reads = []
    for _ in range(3):
        seen.append({})
        with counting_host_reads() as counted, torch.no_grad():
            model(x)
        reads.append(counted.count)
    return {"seen": seen, "reads": reads, "record": sharded._schedule.forward_order}


def test_evaluation_before_any_training_step_prefetches_and_then_reads_the_host_no_more():
    """Was: the order was recorded only by a backward, so every evaluation pass of a fresh model
    read the host after each unit (4 reads per pass here) and never prefetched."""
    for result in run_ranks(_evaluation_before_training, 2):
        assert result["record"] == [0, 1, 2, 3], result
        assert result["reads"][0] == 4, result  # nothing recorded yet: every gather checked at once
        # Then each pass sends the previous one's tags to the host without waiting (checks.py,
        # Note: deferred tag checks; it was one read per pass).
        assert result["reads"][1:] == [0, 0], result
        # Pre-hooks registered after the engine's: the block's own gather is done, the next is in flight.
        assert result["seen"][0] == {"0": [], "1": [], "2": []}, result
        assert result["seen"][1] == result["seen"][2] == {"0": ["blocks.1"], "1": ["blocks.2"], "2": []}, result
