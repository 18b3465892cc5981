"""`ZeRO3Strategy(reductions_in_flight=k)`: Reduce-Scatters overlap the next units' backward
under Lightning and training stays exact (reduce.py, Note: asynchronous reduction)."""

from __future__ import annotations

import pytest
import torch

from tests.lit import LitMLP, become_lightning_rank, loader, max_difference, reference_fit, trainer, whole_state
from tests.ranks import run_ranks

TOL = 1e-5


def _fit_overlapping(rank: int, world_size: int, reductions_in_flight: int | None) -> dict:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP()
    strategy = ZeRO3Strategy(reductions_in_flight=reductions_in_flight)
    trainer(strategy, world_size, max_epochs=1).fit(model, loader(world_size))
    return {
        "state": whole_state(model),
        "losses": model.step_losses,
        "in_flight": strategy.sharded_model.gradient_sync.reductions.in_flight,
    }


def test_overlapping_reductions_are_exact_under_lightning() -> None:
    torch.manual_seed(0)
    reference = LitMLP()
    losses = reference_fit(reference, epochs=1)
    for result in run_ranks(_fit_overlapping, 2, 2):
        assert result["in_flight"] == 2  # the option reaches the engine
        assert max_difference(result["state"], reference.state_dict()) < TOL
        assert max(abs(a - b) for a, b in zip(result["losses"], losses)) < TOL


def test_reductions_in_flight_defaults_to_none_on_cpu_and_rejects_bad_values() -> None:
    from lightning_zero3 import ZeRO3Strategy

    assert ZeRO3Strategy().config.reductions_in_flight is None  # resolved by the engine: 2 on CUDA, 0 elsewhere
    from lightning_zero3.engine import ShardedModel

    assert ShardedModel(torch.nn.Linear(4, 4)).gradient_sync.reductions.in_flight == 0  # CPU parameters
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="reductions_in_flight"):
            ZeRO3Strategy(reductions_in_flight=bad)
