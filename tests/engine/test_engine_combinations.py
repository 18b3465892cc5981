"""The memory and communication settings together (issue 21: `reshard_after_forward`, accumulation
without communication, host offload, optimizer state on disk, with `shard_size`, clipping and
frozen units): each combination a user may pick trains like one process. Each setting alone has
its own tests (test_engine_reshard.py, test_engine_no_sync.py, test_offload.py); these catch what
one setting assumes of another (where tensors live, what a kept unit or a sum holds)."""

from __future__ import annotations

import tempfile
from functools import partial

import lightning.pytorch as pl
import pytest
import torch

from tests.support.adapted import HandsBack, SavesAfterFit, launched
from tests.support.lit import LitMLP, loader, max_difference, reference_fit, trainer, whole_state
from tests.support.models import MLP, mlp_batch, mlp_frozen_block
from tests.support.parity import Recipe, adamw, run_parity
from tests.support.ranks import run_ranks

TOL = 1e-5
BATCH = partial(mlp_batch, batch=16)  # splits evenly over 2 and 4 ranks


def _recipe(model, *, no_sync: bool = False, **options) -> Recipe:
    accumulate = 2 if no_sync else 1
    return Recipe(model=model, batch=BATCH, optimizer=adamw, steps=2, accumulate=accumulate, no_sync=no_sync,
                  clip_norm=0.05, sharded_kwargs=options)  # fmt: skip


COMBINATIONS = {
    2: {
        "no-reshard + no-sync": _recipe(mlp_frozen_block, no_sync=True, reshard_after_forward=False),
        "host + no-sync": _recipe(mlp_frozen_block, no_sync=True, offload="host"),
        "host + no-reshard": _recipe(MLP, offload="host", reshard_after_forward=False),
        "host + disk + shard_size 1 + no-sync": _recipe(MLP, no_sync=True, offload="host", offload_dir="TMP",
                                                        shard_size=1),
    },
    4: {
        "G=2 + no-sync": _recipe(mlp_frozen_block, no_sync=True, reshard_after_forward=2),
        "G=2 + host + shard_size 4": _recipe(MLP, offload="host", reshard_after_forward=2, shard_size=4),
        "no-reshard + host + disk + shard_size 2 + no-sync": _recipe(
            MLP, no_sync=True, reshard_after_forward=False, offload="host", offload_dir="TMP", shard_size=2
        ),
    },
}  # fmt: skip


def _run(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for name, recipe in COMBINATIONS[world_size].items():
            if recipe.sharded_kwargs.get("offload_dir") == "TMP":
                recipe.sharded_kwargs["offload_dir"] = directory
            results[name] = run_parity(rank, world_size, recipe)
    return results


def _check(world_size: int) -> None:
    for rank_results in run_ranks(_run, world_size):
        for name, worst in rank_results.items():
            for key in ("param", "grad", "loss", "norm"):
                assert worst[key] < TOL, f"{name}: {key} differs from one process by {worst[key]:.3g}"
            assert worst["moved"] > 100 * TOL, f"{name}: the reference did not train"
            assert worst["min_norm"] > 0.05, f"{name}: the clip value must clip"


@pytest.mark.slow
def test_settings_combined_at_2_ranks_match_one_process() -> None:
    _check(2)


@pytest.mark.slow
def test_settings_combined_at_4_ranks_match_one_process() -> None:
    _check(4)


def test_combinations_cover_every_setting() -> None:
    """Each setting appears in some combination above (a new setting needs one)."""
    used = {key for group in COMBINATIONS.values() for r in group.values() for key in r.sharded_kwargs}
    used |= {"no_sync"} if any(r.no_sync for g in COMBINATIONS.values() for r in g.values()) else set()
    assert {"reshard_after_forward", "offload", "offload_dir", "shard_size", "no_sync"} <= used


SETTINGS = {"reshard_after_forward": False, "offload": "host", "accumulate_unsharded": True}
FIT = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm", "accumulate_grad_batches": 2}


@pytest.mark.slow
def test_trainer_with_the_settings_combined_resumes_at_another_world_size_like_one_process(tmp_path) -> None:
    """reshard_after_forward=False, host offload with optimizer state on disk, accumulation without
    communication, clipping: saved at 2 ranks, resumed at 3; epoch 2 equals an uninterrupted run."""
    path = str(tmp_path / "combined.ckpt")
    torch.manual_seed(0)
    first = trainer(
        launched("zero3", **SETTINGS, offload_dir=str(tmp_path)),
        2,
        max_epochs=1,
        callbacks=[SavesAfterFit(path)],
        **FIT,
    )
    first.fit(LitMLP(), loader(2))
    torch.manual_seed(0)
    reference = LitMLP()
    losses = reference_fit(reference, epochs=2, accumulate=2, clip_norm=0.05)
    torch.manual_seed(0)
    hands_back = HandsBack(losses="lightning_module.step_losses", state="lightning_module.whole")
    resumed = trainer(
        launched("zero3", **SETTINGS, offload_dir=str(tmp_path)),
        3,
        max_epochs=2,
        callbacks=[_WholeAtRest(), hands_back],
        **FIT,
    )
    resumed.fit(LitMLP(), loader(3), ckpt_path=path)
    results = resumed.callback_metrics
    for step_losses, state in zip(results["losses"], results["state"], strict=True):
        assert len(step_losses) == 4
        assert max(abs(a - b) for a, b in zip(step_losses, losses[4:8])) < TOL
        assert max_difference(state, reference.state_dict()) < TOL


class _WholeAtRest(pl.Callback):
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.whole = whole_state(pl_module)
