"""A module registered under two parents (one layer shared by every block) is one set of
parameters with several names: `state_dict()` lists it under each path, and so must
`full_state_dict()`, with the whole tensor under every name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero3.engine import ShardedModel
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks


class SharedLayerModel(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.shared = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim)) for _ in range(2))
        for block in self.blocks:
            block.add_module("shared", self.shared)  # the same module under each block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block.shared(torch.tanh(block[0](x)))
        return x


def _full_state(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = SharedLayerModel()
    torch.manual_seed(0)
    model = SharedLayerModel()
    sharded = ShardedModel(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    F.mse_loss(reference(x), y).backward()
    F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    for optimizer in optimizers:
        optimizer.step()
    full = sharded.full_state_dict(to_rank=None)
    expected = reference.state_dict()
    sharded.load_full_state_dict(expected)  # every name, whole: loads without complaint
    return {
        "keys": sorted(full) == sorted(expected),
        "diff": max(float((full[k] - v).abs().max()) for k, v in expected.items()),
        "shapes": {k: tuple(v.shape) for k, v in full.items()},
        "expected_shapes": {k: tuple(v.shape) for k, v in expected.items()},
    }


def test_full_state_dict_gives_a_shared_module_whole_under_every_name():
    for result in run_ranks(_full_state, 2):
        assert result["keys"]
        assert result["shapes"] == result["expected_shapes"], "a name of the shared layer got this rank's shard"
        assert result["diff"] < 1e-5
