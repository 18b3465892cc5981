"""Accumulation without communication through Lightning (engine/accumulate.py): Fabric's
`no_backward_sync(model)` and the Trainer's `accumulate_grad_batches` with
`accumulate_unsharded=True` sum the unsharded gradients locally on the micro-batches before the
last and Reduce-Scatter once, training exactly like one process."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import accounting
from tests.support import models
from tests.support.adapted import HandsBack, launched
from tests.support.fabric_helpers import adamw, every_rank, full_state, launch, max_difference
from tests.support.lit import LitMLP, loader, reference_fit, trainer
from tests.support.parity import local_slice

TOL = 1e-5
K = 2


def _fabric_accumulates(f: Any) -> list[dict[str, Any]]:
    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    model = models.MLP()
    model, optimizer = f.setup(model, adamw(model))
    engine = f.strategy.sharded_model(model)
    out: dict[str, Any] = {"reduce_scatters": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            for micro in range(K):
                x, y = models.mlp_batch(step * K + micro)
                with f.no_backward_sync(model, enabled=micro < K - 1):
                    loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
                    f.backward(loss / K)
            optimizer.step()
            optimizer.zero_grad()
            out["reduce_scatters"].append(engine.stats.shard_group.last_step["reduce_scatter"].calls)
    out["warnings"] = [str(w.message) for w in caught if "gradient synchronization" in str(w.message)]
    out["state"] = full_state(f, model)
    out["units"] = sum(1 for u in engine._units if u.params)
    return every_rank(out)


def _reference_accumulating(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = adamw(model)
    for step in range(steps):
        for micro in range(K):
            x, y = models.mlp_batch(step * K + micro)
            (F.mse_loss(model(x), y) / K).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_fabric_no_backward_sync_accumulates_locally_and_matches_single_process() -> None:
    reference = _reference_accumulating(2)
    for result in launch(_fabric_accumulates):
        assert not result["warnings"], result["warnings"]  # Fabric warned that it did nothing
        assert result["reduce_scatters"] == [result["units"]] * 2, result  # one per unit per step, not K
        assert max_difference(result["state"], reference) < TOL


class _Accumulation(pl.Callback):
    """Whether each backward synced; after `fit`, the last step's Reduce-Scatter bytes against the
    formula's, and what `strategy.stats` (what users read) shows against its formula."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        sync = trainer.strategy.sharded_model()._gradient_sync.requires_sync
        pl_module.syncs = [*getattr(pl_module, "syncs", []), sync]

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.sharded_model()
        assert engine.stats.last_step_record is not None
        stats = trainer.strategy.stats
        shown = {kind: stats["last_step"][kind]["payload_bytes"] for kind in ("all_gather", "reduce_scatter")}
        formula = accounting.expected_step_bytes(
            engine._units, engine._persistent, orders=engine.stats.last_step_record.orders, micro_batches=K, synced=1
        )
        pl_module.accumulation = {
            "reduce_scatter": engine.stats.shard_group.last_step["reduce_scatter"].payload_bytes,
            "formula": formula["reduce_scatter"],
            "shown": shown,
            "shown_formula": {kind: stats["expected_step_bytes"][kind] for kind in shown},
            "sync_state": engine._gradient_sync.state.name,
        }


@pytest.mark.slow
def test_trainer_accumulate_unsharded_matches_single_process_with_one_reduction_per_step() -> None:
    torch.manual_seed(0)
    reference = LitMLP()
    reference_fit(reference, epochs=1, accumulate=K)
    torch.manual_seed(0)
    model = LitMLP()
    every_rank = HandsBack(syncs="lightning_module.syncs", accumulation="lightning_module.accumulation")
    strategy = launched("zero3", accumulate_unsharded=True)
    fit = trainer(strategy, 2, max_epochs=1, accumulate_grad_batches=K, callbacks=[_Accumulation(), every_rank])
    fit.fit(model, loader(2))
    assert max_difference(model.state_dict(), reference.state_dict()) < TOL
    for syncs, result in zip(fit.callback_metrics["syncs"], fit.callback_metrics["accumulation"], strict=True):
        assert syncs == [False, True] * 2, syncs  # Lightning's non-final micro-batches unsynced
        assert result["reduce_scatter"] == result["formula"], result
        assert result["shown"] == result["shown_formula"], result
        assert result["sync_state"] == "SYNCED"


def _fabric_saves_while_owed(f: Any, directory: str) -> list[list[str]]:
    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    model = models.MLP()
    model, optimizer = f.setup(model, adamw(model))
    x, y = models.mlp_batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f.save(f"{directory}/synced", {"model": model, "optimizer": optimizer})  # nothing owed: no warning
        with f.no_backward_sync(model):
            f.backward(F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)))
        f.save(f"{directory}/owed", {"model": model, "optimizer": optimizer})
    return every_rank([str(w.message) for w in caught if "owed" in str(w.message)])


def test_a_save_between_unsynced_micro_batches_warns_that_their_sums_are_not_saved(tmp_path) -> None:
    for messages in launch(_fabric_saves_while_owed, str(tmp_path)):
        assert len(messages) == 1 and "/owed while gradients summed" in messages[0], messages
        assert "a resume repeats those micro-batches" in messages[0]
