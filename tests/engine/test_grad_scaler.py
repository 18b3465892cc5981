"""fp16 loss scaling: every rank takes the same skip decision on every path of `GradScaler.step`,
including optimizers that unscale inside their own fused kernel (engine/optim.py, Note: every
path unscales)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_zero3.engine import AgreeingGradScaler, ShardedModel
from tests.support import models
from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, loader, trainer
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks


def _overflow_in_this_ranks_shard(model: torch.nn.Module) -> None:
    """An inf in one element of this rank's gradient shard only (an overflow in the part of the
    reduced gradient this rank holds): an inf in the loss would reach every rank's shard through
    the Reduce-Scatter's sum."""
    next(model.parameters()).grad[0] = float("inf")


def _fused_step_with_inf_on_rank_1(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = models.MLP()
    sharded = ShardedModel(model, param_dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = AgreeingGradScaler(sharded, device="cpu", init_scale=2.0**10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = models.mlp_batch(0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(local_slice(x, rank, world_size)).float(), local_slice(y, rank, world_size))
    scaler.scale(loss).backward()
    if rank == 1:
        _overflow_in_this_ranks_shard(model)
    scaler.step(opt)  # no unscale_ first: Lightning skips it for fused optimizers
    scaler.update()
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
    # A finite step afterwards is taken by every rank.
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(local_slice(x, rank, world_size)).float(), local_slice(y, rank, world_size))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    moved_after = max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())
    return {"moved": moved, "moved_after": moved_after, "scale": scaler.get_scale()}


def test_fused_optimizer_skips_on_every_rank_when_one_rank_overflows() -> None:
    results = run_ranks(_fused_step_with_inf_on_rank_1, 2)
    for result in results:
        assert result["moved"] == 0.0, results  # rank 0's finite shards were not stepped either
        assert result["moved_after"] > 0.0, results  # the next, finite step is taken
        assert result["scale"] == 2.0**9, results  # every rank backed off once


class _FusedOverflowOnRank1(LitMLP):
    """Fused AdamW; rank 1's gradients overflow in the first step. Each rank keeps the loss scale
    and its first shard after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.scales: list[float] = []
        self.shards: list[torch.Tensor] = []

    def on_after_backward(self) -> None:
        if self.global_step == 0 and self.global_rank == 1:
            _overflow_in_this_ranks_shard(self)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)

    def on_train_batch_end(self, *args: Any) -> None:
        self.scales.append(self.trainer.precision_plugin.scaler.get_scale())
        self.shards.append(next(self.parameters()).detach().clone())


def test_trainer_16_mixed_with_a_fused_optimizer_skips_on_every_rank() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    hands_back = HandsBack(scales="lightning_module.scales", shards="lightning_module.shards")
    t = trainer(launched("zero3"), 2, max_steps=2, plugins=[plugin], callbacks=[hands_back])
    t.fit(_FusedOverflowOnRank1(), loader(2))
    scales, shards = t.callback_metrics["scales"], t.callback_metrics["shards"]
    assert scales[0] == scales[1] == [2.0**15, 2.0**15], scales
    for first, second in shards:
        assert not torch.equal(first, second)  # step 1 was taken


def test_a_torch_whose_grad_scaler_keeps_its_inf_flags_elsewhere_is_refused_at_construction(monkeypatch):
    """The fallback of engine/optim.py's Note: private GradScaler state: if a torch release
    moves `found_inf_per_device`, construction raises (on every rank alike) naming the way out,
    instead of letting ranks decide apart."""
    import torch.amp.grad_scaler as grad_scaler

    monkeypatch.setattr(grad_scaler, "_refresh_per_optimizer_state", lambda: {"stage": 0, "inf_flags": {}})
    try:
        AgreeingGradScaler(None, device="cpu")  # type: ignore[arg-type]
    except RuntimeError as err:
        assert "Use precision='bf16-mixed'" in str(err) and torch.__version__ in str(err)
    else:
        raise AssertionError("AgreeingGradScaler accepted a GradScaler without found_inf_per_device")
