"""The Lightning behaviour users rely on keeps working under `strategy="zero3"`: ranks started
by the strategy's launcher (tests/support/adapted.py `launched`), each rank's view handed back
(`HandsBack`), the whole weights handed back by the launcher (under "spawn":
tests/lightning/test_lightning_launchers.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader

from tests.support.adapted import HandsBack, SavesAfterFit, launched
from tests.support.lit import LitMLP, dataset, loader, max_difference, reference_fit, trainer

TOL = 1e-5


def _eval_loss(model: torch.nn.Module) -> float:
    x, y = dataset().tensors
    with torch.no_grad():
        return float(F.mse_loss(model(x), y))


def _launched(world_size: int = 2, options: dict[str, Any] | None = None, **kwargs: Any) -> pl.Trainer:
    """A Trainer whose ranks the strategy's launcher starts, as users of `ddp_spawn` start theirs."""
    return trainer(launched("zero3", **(options or {})), world_size, **kwargs)


class _WritesPredictions(BasePredictionWriter):
    """Each rank's predictions into a file, as users get them under a spawning launcher (which
    returns none)."""

    def __init__(self, directory: str) -> None:
        super().__init__("epoch")
        self.directory = directory

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        torch.save(torch.cat(predictions), os.path.join(self.directory, f"rank{trainer.global_rank}.pt"))


@pytest.mark.slow
def test_validate_fit_test_fit_again_and_predict_match_single_process(tmp_path: Path) -> None:
    """Each call launches its ranks; between calls this process holds the whole weights the launcher
    handed back (a module at rest in the same process: tests/lightning/test_at_rest.py)."""
    torch.manual_seed(0)
    model = LitMLP()
    validate = _launched(callbacks=[HandsBack(loss="callback_metrics.val_loss")])
    validate.validate(model, loader(2))
    _launched(max_steps=2).fit(model, loader(2))
    test = _launched(callbacks=[HandsBack(loss="callback_metrics.test_loss")])
    test.test(model, loader(2))
    _launched(max_steps=2).fit(model, loader(2))
    _launched(callbacks=[_WritesPredictions(str(tmp_path))]).predict(model, DataLoader(dataset(), batch_size=6))
    torch.manual_seed(0)
    reference = LitMLP()
    before = _eval_loss(reference)
    reference_fit(reference, max_steps=2)
    after_first = _eval_loss(reference)
    reference_fit(reference, max_steps=2)  # a second fit starts a fresh optimizer, like the Trainer
    assert all(abs(float(loss) - before) < TOL for loss in validate.callback_metrics["loss"])
    assert all(abs(float(loss) - after_first) < TOL for loss in test.callback_metrics["loss"])
    assert max_difference(model.state_dict(), reference.state_dict()) < TOL
    # predict: each rank predicts its DistributedSampler share (rank r gets samples r, r+2, ...).
    x = dataset().tensors[0]
    with torch.no_grad():
        expected = reference(x)
    for rank in range(2):
        predictions = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert torch.allclose(predictions, expected[rank::2], atol=TOL)


class _SummaryProbe(pl.Callback):
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        callback = next(cb for cb in trainer.callbacks if isinstance(cb, pl.callbacks.ModelSummary))
        summary = callback._summary(trainer, pl_module)
        pl_module.summary_counts = (summary.total_parameters, summary.trainable_parameters, summary.param_nums)


def test_model_summary_shows_full_parameter_counts() -> None:
    full = sum(p.numel() for p in LitMLP().parameters())
    counts = HandsBack(counts="lightning_module.summary_counts")
    fit = _launched(max_steps=1, enable_model_summary=True, callbacks=[_SummaryProbe(), counts])
    fit.fit(LitMLP(), loader(2))
    for total, trainable, per_layer in fit.callback_metrics["counts"]:
        assert total == trainable == full
        assert per_layer == [full]  # max_depth=1: the one child `net`


def test_a_model_summary_without_the_private_summary_method_warns_and_is_left_alone() -> None:
    """The fallback of tools/summary.py's Note: ModelSummary._summary: a Lightning whose ModelSummary has no `_summary`
    keeps its own table (shard sizes) and says so."""
    from lightning_zero3.tools.summary import count_full_parameters

    callback = pl.callbacks.ModelSummary()
    callback._summary = None  # as if this Lightning had dropped the method
    with pytest.warns(UserWarning, match="ModelSummary changed in this Lightning version: .* this rank.s shards"):
        count_full_parameters([callback], lambda p: p.numel())
    assert callback._summary is None


class _LitMetrics(LitMLP):
    def __init__(self) -> None:
        super().__init__()
        self.mae = torchmetrics.MeanAbsoluteError()
        self.seen: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.seen.append(x)
        self.mae.update(self(x), y)
        self.log("val_mae", self.mae, sync_dist=True)
        self.log("val_rank", float(self.global_rank), sync_dist=True, reduce_fx="sum")


def test_distributed_sampler_sync_dist_logging_and_torchmetrics_sync() -> None:
    torch.manual_seed(0)
    model = _LitMetrics()
    every_rank = HandsBack(
        seen="lightning_module.seen", mae="callback_metrics.val_mae", ranks="callback_metrics.val_rank"
    )
    validate = _launched(callbacks=[every_rank])
    validate.validate(model, loader(2))
    x, y = dataset().tensors
    with torch.no_grad():
        expected_mae = float((model(x) - y).abs().mean())
    seen = [torch.cat(rank_seen) for rank_seen in validate.callback_metrics["seen"]]
    # DistributedSampler: each rank saw its own half of the data, together all of it.
    assert seen[0].shape[0] == seen[1].shape[0] == x.shape[0] // 2
    assert torch.equal(torch.sort(torch.cat(seen), dim=0).values, torch.sort(x, dim=0).values)
    for mae, rank_sum in zip(validate.callback_metrics["mae"], validate.callback_metrics["ranks"]):
        assert abs(mae - expected_mae) < TOL  # torchmetrics state synced across ranks
        assert rank_sum == 4 * (0 + 1)  # sync_dist sum over ranks, summed over 4 batches


class _LitEdit(LitMLP):
    def on_train_start(self) -> None:
        strategy = self.trainer.strategy
        with strategy.gathered_parameters(self.net.head, modifier_rank=0):
            self.full_head_shape = tuple(self.net.head.weight.shape)
            if self.global_rank == 0:
                self.net.head.bias.data.fill_(3.0)


def test_gathered_parameters_in_a_hook_shows_whole_tensors_and_keeps_rank0_edits() -> None:
    model = _LitEdit(lr=0.0)
    fit = _launched(max_steps=1, callbacks=[HandsBack(shape="lightning_module.full_head_shape")])
    fit.fit(model, loader(2))
    assert fit.callback_metrics["shape"] == [(5, 13)] * 2
    assert torch.equal(model.state_dict()["net.head.bias"], torch.full((5,), 3.0))


class _StatsAtStep2(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:  # the second step: the first also compares unit orders
            pl_module.stats_at_step_2 = trainer.strategy.stats


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_stats_report_formula_bytes_and_sharded_model_state(world_size: int) -> None:
    full = sum(p.numel() for p in LitMLP().parameters())
    stats_back = HandsBack(stats="lightning_module.stats_at_step_2")
    fit = _launched(world_size, {"prefetch": 1}, max_steps=2, callbacks=[_StatsAtStep2(), stats_back])
    fit.fit(LitMLP(), loader(world_size))
    assert len(fit.callback_metrics["stats"]) == world_size
    for stats in fit.callback_metrics["stats"]:
        assert stats["world_size"] == world_size
        assert stats["full_parameters"] == full
        last, expected = stats["last_step"], stats["expected_step_bytes"]
        assert last["all_gather"]["payload_bytes"] == expected["all_gather"]
        assert last["reduce_scatter"]["payload_bytes"] == expected["reduce_scatter"]
        # Twice per unit but once for the root and the last block (engine/hooks.py, Note: kept for backward).
        assert last["all_gather"]["calls"] == 2 * stats["units"] - 2
        assert last["reduce_scatter"]["calls"] == stats["units"]
        # Padded parameters plus a tag per rank per unit: at most a few elements above Ψ.
        assert full * 4 <= expected["reduce_scatter"] <= (full + stats["units"] * world_size * 8) * 4
        # The engine sent nothing else (no All-Reduce: every parameter is sharded).
        assert set(last) == {"all_gather", "reduce_scatter"}
        ring = (world_size - 1) / world_size
        assert last["all_gather"]["wire_bytes"] == round(last["all_gather"]["payload_bytes"] * ring)
        state = stats["model_state_bytes"]
        assert state["param"] <= 1.01 * 4 * full / world_size + 4 * 32 * world_size
        assert state["optimizer"] == 2 * state["param"]  # AdamW: exp_avg + exp_avg_sq, shard-sized
        assert stats["peak_units_alive_without_root"] <= 1 + 1


@pytest.mark.slow
@pytest.mark.parametrize("resume_world_size", [1, 3])
def test_full_checkpoint_resumes_at_another_world_size(tmp_path: Any, resume_world_size: int) -> None:
    path = str(tmp_path / "model.ckpt")
    torch.manual_seed(0)
    first = LitMLP()
    _launched(2, {"state_dict_type": "full"}, max_epochs=1, callbacks=[SavesAfterFit(path)]).fit(first, loader(2))
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["state_dict"]["net.head.weight"].shape == (5, 13)  # whole tensors on disk
    assert checkpoint["optimizer_states"][0]["state"][0]["exp_avg"].shape == (13, 7)
    torch.manual_seed(0)
    reference = LitMLP()
    losses = reference_fit(reference, epochs=2)
    torch.manual_seed(0)
    model = LitMLP()
    losses_back = HandsBack(losses="lightning_module.step_losses")
    resumed = _launched(resume_world_size, {"state_dict_type": "full"}, max_epochs=2, callbacks=[losses_back])
    resumed.fit(model, loader(resume_world_size), ckpt_path=path)
    assert len(resumed.callback_metrics["losses"]) == resume_world_size
    for step_losses in resumed.callback_metrics["losses"]:
        # The resumed run's second epoch equals that of an uninterrupted run, step by step.
        assert len(step_losses) == 4
        assert max(abs(a - b) for a, b in zip(step_losses, losses[4:8])) < TOL
    assert max_difference(model.state_dict(), reference.state_dict()) < TOL


def test_zero3_is_registered_and_bad_options_raise_clear_errors() -> None:
    import lightning_zero3

    t = pl.Trainer(strategy="zero3", devices=2, accelerator="cpu", logger=False)
    assert isinstance(t.strategy, lightning_zero3.ZeRO3Strategy)
    with pytest.raises(ValueError, match="prefetch"):
        lightning_zero3.ZeRO3Strategy(prefetch=-1)
    with pytest.raises(ValueError, match="state_dict_type"):
        lightning_zero3.ZeRO3Strategy(state_dict_type="zip")
    with pytest.raises(ValueError, match="reductions_in_flight"):
        lightning_zero3.ZeRO3Strategy(reductions_in_flight=-1)
    with pytest.raises(ValueError, match="wrap_policy"):
        lightning_zero3.ZeRO3Strategy(wrap_policy="blocks")
    with pytest.raises(TypeError):
        lightning_zero3.ZeRO3Strategy(1)  # keyword arguments only


class _StatsEveryStep(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.last_stats = trainer.strategy.stats


@pytest.mark.slow
def test_hierarchical_sharding_trains_exactly_and_reports_traffic_inside_and_across_groups() -> None:
    torch.manual_seed(0)
    reference = LitMLP()
    reference_fit(reference, max_steps=3)
    torch.manual_seed(0)
    model = LitMLP()
    stats_back = HandsBack(stats="lightning_module.last_stats")
    fit = _launched(4, {"shard_size": 2}, max_steps=3, callbacks=[_StatsEveryStep(), stats_back])
    fit.fit(model, loader(4))
    assert max_difference(model.state_dict(), reference.state_dict()) < TOL
    assert len(fit.callback_metrics["stats"]) == 4
    for stats in fit.callback_metrics["stats"]:
        assert (stats["world_size"], stats["shard_size"]) == (4, 2)
        assert stats["last_step"]["all_gather"]["payload_bytes"] == stats["expected_step_bytes"]["all_gather"]
        across = stats["last_step_across_groups"]["all_reduce"]["payload_bytes"]
        assert across == stats["expected_step_bytes_across_groups"]["all_reduce"]
        assert across <= 0.51 * stats["expected_step_bytes"]["reduce_scatter"]  # 1/G of the gradient crosses
