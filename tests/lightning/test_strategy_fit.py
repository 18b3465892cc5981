"""`Trainer(strategy="zero3")` trains an unchanged LightningModule exactly like one process on
the global batch: 2 ranks started by the strategy's launcher (tests/support/adapted.py `launched`), whose
whole weights it hands back to this process, against a single-process reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, loader, max_difference, reference_fit, trainer

TOL = 1e-5


def _fit(
    options: dict[str, Any], model_kwargs: dict[str, Any], **strategy_options: Any
) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """The weights handed back after `fit`, and each rank's loss of every optimizer step."""
    torch.manual_seed(0)
    model = LitMLP(**model_kwargs)
    strategy = launched("zero3", **strategy_options)
    fit = trainer(strategy, 2, callbacks=[HandsBack(losses="lightning_module.step_losses")], **options)
    fit.fit(model, loader(2))
    return model.state_dict(), fit.callback_metrics["losses"]


def _reference(model_kwargs: dict, **fit_kwargs: object) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    model = LitMLP(**model_kwargs)
    losses = reference_fit(model, **fit_kwargs)
    return model.state_dict(), losses


@pytest.mark.slow
def test_fit_with_adamw_and_param_groups_matches_single_process() -> None:
    state, losses = _fit({"max_epochs": 2}, {})
    expected_state, expected_losses = _reference({}, epochs=2)
    assert max_difference(state, expected_state) < TOL
    for rank_losses in losses:
        assert len(rank_losses) == len(expected_losses) == 8
        assert max(abs(a - b) for a, b in zip(rank_losses, expected_losses)) < TOL


@pytest.mark.slow
def test_gradient_clipping_by_norm_uses_the_global_norm() -> None:
    state, _ = _fit({"max_epochs": 1, "gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}, {})
    expected, _ = _reference({}, epochs=1, clip_norm=0.05)
    unclipped, _ = _reference({}, epochs=1)
    assert max_difference(expected, unclipped) > 1e-3, "the clip value must actually clip"
    assert max_difference(state, expected) < TOL


@pytest.mark.slow
def test_gradient_clipping_by_value_matches_single_process() -> None:
    state, _ = _fit({"max_epochs": 1, "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}, {"lr": 0.001})
    expected, _ = _reference({"lr": 0.001}, epochs=1, clip_value=0.01)
    assert max_difference(state, expected) < TOL


@pytest.mark.slow
def test_accumulate_grad_batches_matches_single_process() -> None:
    state, _ = _fit({"max_epochs": 1, "accumulate_grad_batches": 2}, {})
    expected, _ = _reference({}, epochs=1, accumulate=2)
    assert max_difference(state, expected) < TOL


@pytest.mark.slow
def test_manual_optimization_matches_single_process() -> None:
    state, losses = _fit({"max_epochs": 1}, {"manual": True})
    expected_state, expected_losses = _reference({}, epochs=1)
    assert max_difference(state, expected_state) < TOL
    for rank_losses in losses:
        assert len(rank_losses) == len(expected_losses)
        assert max(abs(a - b) for a, b in zip(rank_losses, expected_losses)) < TOL


@pytest.mark.slow
def test_activation_checkpointing_inside_lightning_matches_single_process() -> None:
    state, _ = _fit({"max_epochs": 1}, {"checkpointing": "non_reentrant"}, prefetch=2)
    expected, _ = _reference({}, epochs=1)
    assert max_difference(state, expected) < TOL


@pytest.mark.slow
def test_parameters_kept_whole_train_exactly_under_a_forkserver_launch() -> None:
    state, _ = _fit({"max_steps": 2}, {}, persistence_threshold=13)  # norms and small biases kept whole
    expected, _ = _reference({}, max_steps=2)
    assert max_difference(state, expected) < TOL


class _LitAdagradByDim(LitMLP):
    """Groups chosen by `p.dim()` as DDP users do, and an optimizer whose constructor makes its
    state (Adagrad's sums, from `initial_accumulator_value`)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
        return torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1)


@pytest.mark.slow
def test_an_optimizer_building_its_state_in_configure_optimizers_trains_like_one_process() -> None:
    """Before: its state was made for the full shapes shown inside `configure_optimizers` (engine/
    whole_matrix.py, Note: optimizers built on whole shapes) and the first step raised a size mismatch."""
    torch.manual_seed(0)
    model = _LitAdagradByDim()
    fit = trainer(launched("zero3"), 2, callbacks=[HandsBack()], max_epochs=1)
    fit.fit(model, loader(2))
    torch.manual_seed(0)
    reference = _LitAdagradByDim()
    reference_fit(reference, epochs=1)
    assert max_difference(model.state_dict(), reference.state_dict()) < TOL
