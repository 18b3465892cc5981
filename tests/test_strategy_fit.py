"""`Trainer(strategy="zero3")` trains an unchanged LightningModule exactly like one process on
the global batch: 2 real gloo ranks against a single-process reference."""

from __future__ import annotations

import torch

from tests.lit import LitMLP, become_lightning_rank, loader, max_difference, reference_fit, trainer, whole_state
from tests.ranks import run_ranks

TOL = 1e-5


def _fit(rank: int, world_size: int, options: dict, model_kwargs: dict) -> dict:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP(**model_kwargs)
    strategy = ZeRO3Strategy(prefetch=options.pop("prefetch", 1))
    trainer(strategy, world_size, **options).fit(model, loader(world_size))
    return {"state": whole_state(model), "losses": model.step_losses}


def _reference(model_kwargs: dict, **fit_kwargs: object) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    model = LitMLP(**model_kwargs)
    losses = reference_fit(model, **fit_kwargs)
    return model.state_dict(), losses


def test_fit_with_adamw_and_param_groups_matches_single_process() -> None:
    results = run_ranks(_fit, 2, {"max_epochs": 2}, {})
    state, losses = _reference({}, epochs=2)
    for result in results:
        assert max_difference(result["state"], state) < TOL
        assert max(abs(a - b) for a, b in zip(result["losses"], losses)) < TOL
    assert len(results[0]["losses"]) == len(losses) == 8


def test_gradient_clipping_by_norm_uses_the_global_norm() -> None:
    options = {"max_epochs": 1, "gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    results = run_ranks(_fit, 2, options, {})
    state, _ = _reference({}, epochs=1, clip_norm=0.05)
    unclipped, _ = _reference({}, epochs=1)
    assert max_difference(state, unclipped) > 1e-3, "the clip value must actually clip"
    for result in results:
        assert max_difference(result["state"], state) < TOL


def test_gradient_clipping_by_value_matches_single_process() -> None:
    options = {"max_epochs": 1, "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}
    results = run_ranks(_fit, 2, options, {"lr": 0.001})
    state, _ = _reference({"lr": 0.001}, epochs=1, clip_value=0.01)
    for result in results:
        assert max_difference(result["state"], state) < TOL


def test_accumulate_grad_batches_matches_single_process() -> None:
    results = run_ranks(_fit, 2, {"max_epochs": 1, "accumulate_grad_batches": 2}, {})
    state, _ = _reference({}, epochs=1, accumulate=2)
    for result in results:
        assert max_difference(result["state"], state) < TOL


def test_manual_optimization_matches_single_process() -> None:
    results = run_ranks(_fit, 2, {"max_epochs": 1}, {"manual": True})
    state, losses = _reference({}, epochs=1)
    for result in results:
        assert max_difference(result["state"], state) < TOL
        assert max(abs(a - b) for a, b in zip(result["losses"], losses)) < TOL


def test_activation_checkpointing_inside_lightning_matches_single_process() -> None:
    results = run_ranks(_fit, 2, {"max_epochs": 1, "prefetch": 2}, {"checkpointing": "non_reentrant"})
    state, _ = _reference({}, epochs=1)
    for result in results:
        assert max_difference(result["state"], state) < TOL
