"""Mixed precision: 16-bit gathers (half the bytes), a configurable reduce dtype, fp32 master
shards, and a GradScaler whose skip decision every rank shares. The Trainer's ranks are started
by the strategy's launcher (tests/support/adapted.py `launched`), but the refusal of a 16-bit param_dtype
under fp32 precision runs on the gloo harness (tests/support/ranks.py), which reads every rank's error."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_zero3.engine import AgreeingGradScaler, ShardedModel
from lightning_zero3.engine.shard import shard_slice
from tests.support import models
from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, become_lightning_rank, loader, max_difference, reference_fit, trainer
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks


def _train_autocast(rank: int, world_size: int, param_dtype: Any, reduce_dtype: Any, steps: int = 3) -> dict:
    """Sharded model with 16-bit gathers vs a single-process reference, both under bf16 autocast."""
    torch.manual_seed(0)
    reference = models.MLP()
    torch.manual_seed(0)
    model = models.MLP()
    sharded = ShardedModel(model, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    seen_dtypes: set[torch.dtype] = set()
    model.blocks[0].fc1.register_forward_pre_hook(lambda m, a: seen_dtypes.add(m.weight.dtype))
    # SGD: parameter differences stay proportional to gradient differences (AdamW would turn
    # bf16 rounding noise in near-zero gradients into full-size steps).
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worst_loss = 0.0
    for step in range(steps):
        x, y = models.mlp_batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = F.mse_loss(reference(x).float(), y)
            loss = F.mse_loss(model(local_slice(x, rank, world_size)).float(), local_slice(y, rank, world_size))
        ref_loss.backward()
        loss.backward()
        grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        mean = loss.detach().clone()
        sharded._comm.all_reduce(mean, what="test loss")
        worst_loss = max(worst_loss, abs(float(mean) / world_size - float(ref_loss.detach())))
        for opt_ in (ref_opt, opt):
            opt_.step()
            opt_.zero_grad()
        sharded.stats.end_step()
    full = sharded.full_state_dict(to_rank=None)
    last = sharded.stats.shard_group.last_step
    return {
        "loss": worst_loss,
        "param": max_difference(full, reference.state_dict()),
        "gathered": seen_dtypes,
        "shard_dtypes": {p.dtype for p in model.parameters()},
        "grad_dtypes": grad_dtypes,
        "bytes": {k: b.payload_bytes for k, b in last.items()},
        "expected": sharded.stats.expected_step_bytes(),
    }


@pytest.fixture(scope="module")
def bf16_gathers() -> list[dict]:
    """Each rank's view of training with bf16 gathers and fp32 reductions (one run, two tests)."""
    return run_ranks(_train_autocast, 2, torch.bfloat16, None)


def test_bf16_gathers_compute_in_bf16_and_stay_close_to_single_process_autocast(bf16_gathers: list[dict]) -> None:
    for result in bf16_gathers:
        assert result["gathered"] == {torch.bfloat16}  # what is sent (and computed with) is bf16
        assert result["shard_dtypes"] == {torch.float32} and result["grad_dtypes"] == {torch.float32}
        assert result["loss"] < 2e-2 and result["param"] < 2e-2
        assert {k: result["bytes"][k] for k in ("all_gather", "reduce_scatter")} == result["expected"]


@pytest.mark.slow
def test_bf16_gathers_move_half_the_bytes_of_fp32_and_reduce_dtype_is_configurable(
    bf16_gathers: list[dict],
) -> None:
    fp32 = run_ranks(_train_autocast, 2, None, None)[0]["bytes"]
    bf16 = bf16_gathers[0]["bytes"]
    bf16_reduce = run_ranks(_train_autocast, 2, torch.bfloat16, torch.bfloat16)[0]["bytes"]
    # root + 3 blocks, 2 ranks: rows of 2 per unit per collective. A row is the shards, a tag
    # (4 bytes in either dtype) and < 16 bytes of alignment, so half of an fp32 row and a bf16
    # row differ by less than 16 bytes (exact figures: expected_step_bytes, test above).
    rows = 4 * 2
    assert abs(bf16["all_gather"] - fp32["all_gather"] / 2) < 2 * rows * 16
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"]  # fp32 reduction by default
    assert abs(bf16_reduce["reduce_scatter"] - fp32["reduce_scatter"] / 2) < rows * 16


def _scaler_skips_everywhere(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = models.MLP()
    sharded = ShardedModel(model, param_dtype=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = AgreeingGradScaler(sharded, device="cpu", init_scale=2.0**10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = models.mlp_batch(0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(local_slice(x, rank, world_size)).float(), local_slice(y, rank, world_size))
    scaler.scale(loss).backward()
    if rank == 1:
        # Only rank 1's shard overflows. (An infinite loss would reach every rank's shard through
        # the Reduce-Scatter's sum, and the test could not fail.)
        next(model.parameters()).grad[0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
    return {"moved": moved, "scale": scaler.get_scale()}


def test_grad_scaler_skip_decision_is_the_same_on_every_rank() -> None:
    for result in run_ranks(_scaler_skips_everywhere, 2):
        assert result["moved"] == 0.0  # rank 0's finite shards were not stepped either
        assert result["scale"] == 2.0**9  # and every rank backed off


class _WholeDtypes(pl.Callback):
    """The dtypes of the whole weights after `fit`, read the user's way (`full_state_dict`)."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        whole = trainer.strategy.full_state_dict(rank0_only=False)
        pl_module.dtypes = sorted({str(tensor.dtype) for tensor in whole.values()})


@pytest.mark.slow
def test_trainer_bf16_mixed_gathers_in_bf16_and_stays_close_to_single_process() -> None:
    torch.manual_seed(0)
    reference = LitMLP(sgd=True)
    losses = reference_fit(reference, max_steps=3, autocast=torch.bfloat16)
    torch.manual_seed(0)
    model = LitMLP(sgd=True)  # SGD: parameter differences track gradient differences
    every_rank = HandsBack(
        stats="strategy.stats", losses="lightning_module.step_losses", dtypes="lightning_module.dtypes"
    )
    fit = trainer(launched("zero3"), 2, max_steps=3, precision="bf16-mixed", callbacks=[_WholeDtypes(), every_rank])
    fit.fit(model, loader(2))
    back = fit.callback_metrics
    for stats, step_losses, dtypes in zip(back["stats"], back["losses"], back["dtypes"], strict=True):
        assert (stats["param_dtype"], stats["reduce_dtype"]) == ("bfloat16", "float32")
        assert stats["last_step"]["all_gather"]["payload_bytes"] == stats["expected_step_bytes"]["all_gather"]
        assert max(abs(a - b) for a, b in zip(step_losses, losses)) < 2e-2
        assert dtypes == ["torch.float32"]  # fp32 master weights
    assert max_difference(model.state_dict(), reference.state_dict()) < 2e-2


@pytest.mark.slow
def test_bf16_true_holds_bf16_shards_and_trains_like_a_bf16_single_process() -> None:
    torch.manual_seed(0)
    reference = LitMLP(sgd=True).to(torch.bfloat16)
    losses = reference_fit(reference, max_steps=3, input_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = LitMLP(sgd=True)
    every_rank = HandsBack(losses="lightning_module.step_losses", dtypes="lightning_module.dtypes")
    fit = trainer(launched("zero3"), 2, max_steps=3, precision="bf16-true", callbacks=[_WholeDtypes(), every_rank])
    fit.fit(model, loader(2))
    for step_losses, dtypes in zip(fit.callback_metrics["losses"], fit.callback_metrics["dtypes"], strict=True):
        assert dtypes == ["torch.bfloat16"]
        assert max(abs(a - b) for a, b in zip(step_losses, losses)) < 2e-2
    # the launcher's bf16 weights, loaded into this process's fp32 module (every bf16 value is an fp32 one)
    assert max_difference(model.state_dict(), reference.state_dict()) < 2e-2


@pytest.mark.parametrize("value", ["int8", 3, torch.int32])
def test_bad_dtype_options_raise_clear_errors(value: Any) -> None:
    from lightning_zero3 import ZeRO3Strategy

    with pytest.raises(ValueError, match="param_dtype"):
        ZeRO3Strategy(param_dtype=value)


def test_shard_slice_of_a_bf16_tensor_keeps_its_dtype() -> None:
    assert shard_slice(torch.ones(5, dtype=torch.bfloat16), 1, 2).dtype == torch.bfloat16


def _sixteen_bit_without_autocast(rank: int, world_size: int) -> str:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    try:
        trainer(ZeRO3Strategy(param_dtype="bf16"), world_size, max_steps=1).fit(LitMLP(), loader(world_size))
    except ValueError as err:
        return str(err)
    return "trained"


def test_sixteen_bit_param_dtype_under_fp32_precision_raises_a_clear_error() -> None:
    for message in run_ranks(_sixteen_bit_without_autocast, 2):
        assert "precision='bf16-mixed'" in message and "param_dtype" in message


@pytest.mark.slow
def test_trainer_16_mixed_loss_scaling_agrees_on_skips_and_counts_the_flag() -> None:
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    every_rank = HandsBack(scaler="precision_plugin.scaler.__class__.__name__", stats="strategy.stats")
    fit = trainer(launched("zero3"), 2, max_steps=2, plugins=[plugin], callbacks=[every_rank])
    fit.fit(LitMLP(), loader(2))
    assert fit.callback_metrics["scaler"] == ["AgreeingGradScaler"] * 2
    for stats in fit.callback_metrics["stats"]:
        assert stats["param_dtype"] == "float16"
        assert stats["last_step_control"]["all_reduce"]["calls"] == 1  # the inf/NaN flag, once per step


class _FusedAdamW(LitMLP):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        from tests.support.lit import param_groups

        return torch.optim.AdamW(param_groups(self), lr=self.lr, fused=True)


@pytest.mark.slow
def test_trainer_16_mixed_clips_with_a_fused_optimizer_like_one_process() -> None:
    """Lightning's own 16-mixed plugin raises for clipping with a fused optimizer (its gradients
    are still scaled when clipping runs); ours unscales first, then clips by the global norm."""
    torch.manual_seed(0)
    model = _FusedAdamW()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))  # the flag means bf16 on CPU
    losses_back = HandsBack(losses="lightning_module.step_losses")
    fit = trainer(launched("zero3"), 2, max_steps=4, plugins=[plugin], gradient_clip_val=0.05, callbacks=[losses_back])
    fit.fit(model, loader(2))
    torch.manual_seed(0)
    reference = LitMLP()
    ref_losses = reference_fit(reference, max_steps=4, clip_norm=0.05, autocast=torch.float16)
    for losses in fit.callback_metrics["losses"]:
        assert losses == pytest.approx(ref_losses, rel=2e-3)
    param = max_difference(model.state_dict(), reference.state_dict())
    assert param < 2e-3, param
