"""A parameter whose shard would be one element (a 0-d scale, a (1,) bias) stays whole on every
rank: a one-element shard broadcasts against any shape, so another unit's forward reading it
would compute wrong numbers on the ranks holding padding instead of failing on a shape."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero3.engine.plan import make_plan
from tests.support.models import mlp_batch
from tests.support.parity import Recipe, run_parity
from tests.support.ranks import run_ranks

TOL = 1e-6


class ScaleReadByTheRoot(nn.Module):
    """`blocks[1].scale` belongs to a block's unit but is read in the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 3)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(2)])
        self.blocks[1].register_parameter("scale", nn.Parameter(torch.tensor(0.5)))
        self.out = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h * self.blocks[1].scale)


def _adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)  # type: ignore[arg-type]


def test_a_scalar_read_outside_its_unit_trains_like_one_process() -> None:
    recipe = Recipe(model=ScaleReadByTheRoot, batch=mlp_batch, optimizer=_adamw, steps=3, clip_norm=0.05)
    for result in run_ranks(run_parity, 2, recipe):
        assert max(result[k] for k in ("param", "grad", "loss")) < TOL, result


def test_parameters_of_at_most_group_size_elements_are_kept_whole() -> None:
    model = ScaleReadByTheRoot()
    model.blocks[0][0].register_parameter("pair", nn.Parameter(torch.ones(2)))
    whole = {name for entry in make_plan(model, shard_group_size=2).persistent for name in entry.names}
    assert whole == {"blocks.1.scale", "blocks.0.0.pair"}
    one_rank = {name for entry in make_plan(model, shard_group_size=1).persistent for name in entry.names}
    assert one_rank == {"blocks.1.scale"}
