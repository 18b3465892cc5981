"""The Lightning behaviour users rely on keeps working under `strategy="zero3"`."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import DataLoader

from tests.lit import (
    LitMLP,
    become_lightning_rank,
    dataset,
    loader,
    max_difference,
    reference_fit,
    trainer,
    whole_state,
)
from tests.ranks import run_ranks

TOL = 1e-5


def _eval_loss(model: torch.nn.Module) -> float:
    x, y = dataset().tensors
    with torch.no_grad():
        return float(F.mse_loss(model(x), y))


def _validate_fit_validate_fit(rank: int, world_size: int) -> dict[str, Any]:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP()
    out: dict[str, Any] = {}
    out["validate_before"] = trainer(ZeRO3Strategy(), world_size).validate(model, loader(world_size))[0]["val_loss"]
    trainer(ZeRO3Strategy(), world_size, max_steps=2).fit(model, loader(world_size))
    out["test_after_first_fit"] = trainer(ZeRO3Strategy(), world_size).test(model, loader(world_size))[0]["test_loss"]
    trainer(ZeRO3Strategy(), world_size, max_steps=2).fit(model, loader(world_size))
    predictions = trainer(ZeRO3Strategy(), world_size).predict(model, DataLoader(dataset(), batch_size=6))
    out["predictions"] = torch.cat(predictions)
    out["state"] = whole_state(model)
    return out


def test_validate_fit_test_fit_again_and_predict_match_single_process() -> None:
    results = run_ranks(_validate_fit_validate_fit, 2)
    torch.manual_seed(0)
    reference = LitMLP()
    before = _eval_loss(reference)
    reference_fit(reference, max_steps=2)
    after_first = _eval_loss(reference)
    reference_fit(reference, max_steps=2)  # a second fit starts a fresh optimizer, like the Trainer
    for result in results:
        assert abs(float(result["validate_before"]) - before) < TOL
        assert abs(float(result["test_after_first_fit"]) - after_first) < TOL
        # Each new strategy makes the module at rest whole first, then shards it (left_sharded.py).
        assert max_difference(result["state"], reference.state_dict()) < TOL
    # predict: each rank predicts its DistributedSampler share (rank r gets samples r, r+2, ...).
    x = dataset().tensors[0]
    with torch.no_grad():
        expected = reference(x)
    for rank, result in enumerate(results):
        assert torch.allclose(result["predictions"], expected[rank::2], atol=TOL)


class _SummaryProbe(pl.Callback):
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        callback = next(cb for cb in trainer.callbacks if isinstance(cb, pl.callbacks.ModelSummary))
        summary = callback._summary(trainer, pl_module)
        pl_module.summary_counts = (summary.total_parameters, summary.trainable_parameters, summary.param_nums)


def _summary(rank: int, world_size: int) -> Any:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    model = LitMLP()
    shard_numels = sum(p.numel() for p in model.parameters())
    t = trainer(ZeRO3Strategy(), world_size, max_steps=1, enable_model_summary=True, callbacks=[_SummaryProbe()])
    t.fit(model, loader(world_size))
    return shard_numels, model.summary_counts


def test_model_summary_shows_full_parameter_counts() -> None:
    full = sum(p.numel() for p in LitMLP().parameters())
    for full_before, (total, trainable, per_layer) in run_ranks(_summary, 2):
        assert full_before == full
        assert total == trainable == full
        assert per_layer == [full]  # max_depth=1: the one child `net`


def test_a_model_summary_without_the_private_summary_method_warns_and_is_left_alone() -> None:
    """The fallback of summary.py's Note: a Lightning whose ModelSummary has no `_summary`
    keeps its own table (shard sizes) and says so."""
    from lightning_zero3.summary import count_full_parameters

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


def _metrics(rank: int, world_size: int) -> Any:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = _LitMetrics()
    metrics = trainer(ZeRO3Strategy(), world_size).validate(model, loader(world_size))[0]
    return metrics, torch.cat(model.seen)


def test_distributed_sampler_sync_dist_logging_and_torchmetrics_sync() -> None:
    results = run_ranks(_metrics, 2)
    x, y = dataset().tensors
    torch.manual_seed(0)
    reference = _LitMetrics()
    with torch.no_grad():
        expected_mae = float((reference(x) - y).abs().mean())
    seen = [seen for _, seen in results]
    # DistributedSampler: each rank saw its own half of the data, together all of it.
    assert seen[0].shape[0] == seen[1].shape[0] == x.shape[0] // 2
    assert torch.equal(torch.sort(torch.cat(seen), dim=0).values, torch.sort(x, dim=0).values)
    for metrics, _ in results:
        assert abs(metrics["val_mae"] - expected_mae) < TOL  # torchmetrics state synced across ranks
        assert metrics["val_rank"] == 4 * (0 + 1)  # sync_dist sum over ranks, summed over 4 batches


class _LitEdit(LitMLP):
    def on_train_start(self) -> None:
        strategy = self.trainer.strategy
        with strategy.gathered_parameters(self.net.head, modifier_rank=0):
            self.full_head_shape = tuple(self.net.head.weight.shape)
            if self.global_rank == 0:
                self.net.head.bias.data.fill_(3.0)


def _edit(rank: int, world_size: int) -> Any:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    model = _LitEdit(lr=0.0)
    trainer(ZeRO3Strategy(), world_size, max_steps=1).fit(model, loader(world_size))
    return model.full_head_shape, whole_state(model)["net.head.bias"]


def test_gathered_parameters_in_a_hook_shows_whole_tensors_and_keeps_rank0_edits() -> None:
    for shape, bias in run_ranks(_edit, 2):
        assert shape == (5, 13)
        assert torch.equal(bias, torch.full((5,), 3.0))


def _stats(rank: int, world_size: int) -> Any:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    class _Probe(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:  # the second step: the first also compares unit orders
                self.stats = trainer.strategy.stats

    probe = _Probe()
    trainer(ZeRO3Strategy(prefetch=1), world_size, max_steps=2, callbacks=[probe]).fit(LitMLP(), loader(world_size))
    return probe.stats


@pytest.mark.parametrize("world_size", [2, 3])
def test_stats_report_formula_bytes_and_sharded_model_state(world_size: int) -> None:
    full = sum(p.numel() for p in LitMLP().parameters())
    for stats in run_ranks(_stats, world_size):
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


def _checkpoint_and_resume(rank: int, world_size: int, directory: str, resume: bool) -> Any:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP()
    path = os.path.join(directory, "model.ckpt")
    if not resume:
        t = trainer(ZeRO3Strategy(state_dict_type="full"), world_size, max_epochs=1)
        t.fit(model, loader(world_size))
        t.save_checkpoint(path)
        return None
    t = trainer(ZeRO3Strategy(state_dict_type="full"), world_size, max_epochs=2)
    t.fit(model, loader(world_size), ckpt_path=path)
    return model.step_losses, whole_state(model)


@pytest.mark.parametrize("resume_world_size", [1, 3])
def test_full_checkpoint_resumes_at_another_world_size(tmp_path: Any, resume_world_size: int) -> None:
    run_ranks(_checkpoint_and_resume, 2, str(tmp_path), False)
    checkpoint = torch.load(tmp_path / "model.ckpt", weights_only=False)
    assert checkpoint["state_dict"]["net.head.weight"].shape == (5, 13)  # whole tensors on disk
    assert checkpoint["optimizer_states"][0]["state"][0]["exp_avg"].shape == (13, 7)
    torch.manual_seed(0)
    reference = LitMLP()
    losses = reference_fit(reference, epochs=2)
    for step_losses, state in run_ranks(_checkpoint_and_resume, resume_world_size, str(tmp_path), True):
        # The resumed run's second epoch equals that of an uninterrupted run, step by step.
        assert len(step_losses) == 4
        assert max(abs(a - b) for a, b in zip(step_losses, losses[4:8])) < TOL
        assert max_difference(state, reference.state_dict()) < TOL


def test_spawn_launcher_hands_back_whole_weights() -> None:
    import lightning_zero3

    torch.manual_seed(0)
    model = LitMLP()
    strategy = lightning_zero3.ZeRO3Strategy(start_method="spawn", timeout=__import__("datetime").timedelta(seconds=60))
    trainer(strategy, 2, max_steps=2).fit(model, loader(2))
    torch.manual_seed(0)
    reference = LitMLP()
    reference_fit(reference, max_steps=2)
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


def _hybrid(rank: int, world_size: int) -> Any:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    class _Probe(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.stats = trainer.strategy.stats

    probe = _Probe()
    torch.manual_seed(0)
    model = LitMLP()
    trainer(ZeRO3Strategy(shard_size=2), world_size, max_steps=3, callbacks=[probe]).fit(model, loader(world_size))
    return probe.stats, whole_state(model)


def test_hierarchical_sharding_trains_exactly_and_reports_traffic_inside_and_across_groups() -> None:
    torch.manual_seed(0)
    reference = LitMLP()
    reference_fit(reference, max_steps=3)
    for stats, state in run_ranks(_hybrid, 4):
        assert max_difference(state, reference.state_dict()) < TOL
        assert (stats["world_size"], stats["shard_size"]) == (4, 2)
        assert stats["last_step"]["all_gather"]["payload_bytes"] == stats["expected_step_bytes"]["all_gather"]
        across = stats["last_step_across_groups"]["all_reduce"]["payload_bytes"]
        assert across == stats["expected_step_bytes_across_groups"]["all_reduce"]
        assert across <= 0.51 * stats["expected_step_bytes"]["reduce_scatter"]  # 1/G of the gradient crosses
