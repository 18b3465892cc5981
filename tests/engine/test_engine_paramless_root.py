"""A root module without parameters of its own (`nn.Sequential` of blocks) still frames one
pass: its units run in one recorded order, the next unit is prefetched while one computes,
and a step issues no more All-Gathers than a model whose root has parameters."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero3.engine import ShardedModel
from tests.support.models import Block
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks


def _blocks(depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(7) for _ in range(depth)))


def _batch(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 7, generator=generator), torch.randn(8, 7, generator=generator)
    return local_slice(x, rank, world_size), local_slice(y, rank, world_size)


def _in_flight_while_each_block_runs(rank: int, world_size: int) -> dict:
    model = _blocks()
    sharded = ShardedModel(model, prefetch=1)
    assert not sharded._units[0].params, "the test needs a root unit without parameters"
    x, y = _batch(rank, world_size)
    F.mse_loss(model(x), y).backward()  # records the order
    seen: dict[str, list[str]] = {}

    def note_in_flight(name: str, *_: object) -> None:
        seen[name] = [unit.name for unit in sharded._units if unit.gather_in_flight]

    for name, block in model.named_children():
        block.register_forward_hook(partial(note_in_flight, name))
    F.mse_loss(model(x), y).backward()
    return {"seen": seen, "forward_order": sharded._schedule.forward_order}


def test_a_paramless_root_prefetches_the_next_unit_in_forward():
    for result in run_ranks(_in_flight_while_each_block_runs, 2):
        assert result["seen"] == {"0": ["1"], "1": ["2"], "2": []}, result


def _gathers_per_step(rank: int, world_size: int) -> list[int]:
    model = _blocks()
    sharded = ShardedModel(model, prefetch=1)
    x, y = _batch(rank, world_size)
    calls = []
    for _ in range(3):
        F.mse_loss(model(x), y).backward()
        sharded.stats.end_step()
        calls.append(sharded.stats.shard_group.last_step["all_gather"].calls)
    return calls


def test_a_paramless_root_gathers_each_unit_once_per_pass():
    for calls in run_ranks(_gathers_per_step, 2):
        # 3 units, each gathered for forward and for backward; once the order is recorded (step
        # 2 on), the last one is kept from forward into backward (hooks.py, Note: kept for backward).
        assert calls == [6, 5, 5], calls
