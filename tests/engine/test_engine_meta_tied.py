"""A tied parameter kept whole (persistent) and built on the meta device stays one parameter
after materialisation, so its gradient is averaged and the ranks stay equal."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.materialize import parameters_on_meta
from tests.support.ranks import run_ranks


class _TiedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def _one_step_on_meta_built_model(rank: int, world_size: int) -> tuple[bool, list[list[float]]]:
    with parameters_on_meta("cpu"):
        model = _TiedEmbedding()
    ShardedModel(model, persistence_threshold=10**6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.tensor([[rank, 4 - rank]])).square().mean().backward()  # other data on each rank
    optimizer.step()
    return model.out.weight is model.emb.weight, model.out.weight.tolist()


def test_a_tied_persistent_parameter_built_on_meta_stays_tied_and_equal_on_every_rank() -> None:
    results = run_ranks(_one_step_on_meta_built_model, 2)
    assert all(tied for tied, _ in results)
    assert results[0][1] == results[1][1]
