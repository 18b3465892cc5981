"""`ZeRO3Strategy(reductions_in_flight=k)`: Reduce-Scatters overlap the next units' backward
under Lightning and training stays exact (reduce.py, Note: asynchronous reduction). 2 ranks
started by the strategy's launcher (tests/support/adapted.py `launched`)."""

from __future__ import annotations

import pytest
import torch

from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, loader, max_difference, reference_fit, trainer

TOL = 1e-5


@pytest.mark.slow
def test_overlapping_reductions_are_exact_under_lightning() -> None:
    torch.manual_seed(0)
    reference = LitMLP()
    losses = reference_fit(reference, epochs=1)
    torch.manual_seed(0)
    model = LitMLP()
    hands_back = HandsBack(
        in_flight="strategy.run.engine._gradient_sync.reductions.in_flight", losses="lightning_module.step_losses"
    )
    fit = trainer(launched("zero3", reductions_in_flight=2), 2, max_epochs=1, callbacks=[hands_back])
    fit.fit(model, loader(2))
    assert fit.callback_metrics["in_flight"] == [2, 2]  # the option reaches the engine of every rank
    assert max_difference(model.state_dict(), reference.state_dict()) < TOL
    for rank_losses in fit.callback_metrics["losses"]:
        assert len(rank_losses) == len(losses)
        assert max(abs(a - b) for a, b in zip(rank_losses, losses)) < TOL


def test_reductions_in_flight_defaults_to_none_on_cpu_and_rejects_bad_values() -> None:
    from lightning_zero3 import ZeRO3Strategy

    assert ZeRO3Strategy().config.reductions_in_flight is None  # resolved by the engine: 1 on CUDA, 0 elsewhere
    from lightning_zero3.engine import ShardedModel

    assert ShardedModel(torch.nn.Linear(4, 4))._gradient_sync.reductions.in_flight == 0  # CPU parameters
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="reductions_in_flight"):
            ZeRO3Strategy(reductions_in_flight=bad)
