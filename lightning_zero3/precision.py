"""Lightning precision plugins for sharded training: clipping by the norm of the whole gradient
(one All-Reduce over every rank's shards), and fp16 loss scaling that skips a step on every rank
or on none (`AgreeingGradScaler`).

[Note: explicit precision plugins]
Clipping goes from the LightningModule to the precision plugin with no strategy in between, so
setup swaps in Lightning's plugin for the flag plus clipping over shards (docs/design.md,
explicit precision plugins).
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero3.engine import AgreeingGradScaler, ShardedModel, clip_grad_norm_


class _GlobalNormClipping(Precision):
    """Clipping by norm over every rank's gradient shards."""

    sharded_model: ShardedModel | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.sharded_model is None:
            raise RuntimeError(f"{type(self).__name__} clips sharded gradients but has no sharded model yet.")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(self.sharded_model, params, float(clip_val))

    def __getstate__(self) -> dict[str, object]:
        # The engine holds this process's process groups: `torch.save(trainer)` leaves it behind.
        return {**self.__dict__, "sharded_model": None}


class ZeRO3Precision(_GlobalNormClipping, Precision):
    """`precision="32-true"` with shards."""


class ZeRO3MixedPrecision(_GlobalNormClipping, MixedPrecision):
    """`precision="16-mixed"` / `"bf16-mixed"` with shards. Clipping with an optimizer that
    unscales inside its step (fused AdamW), which Lightning's plugin refuses, unscales first (torch's
    GradScaler then passes no scale to the step). The flag is torch's private
    `Optimizer._step_supports_amp_scaling`, the one Lightning reads (torch 2.13-2.14 tried); an
    optimizer without it is treated as unscaling nothing itself."""

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and self.scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            self.scaler.unscale_(optimizer)
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


class ZeRO3HalfPrecision(_GlobalNormClipping, HalfPrecision):
    """`precision="16-true"` / `"bf16-true"` with shards."""


class ZeRO3DoublePrecision(_GlobalNormClipping, DoublePrecision):
    """`precision="64-true"` with shards."""


def sharded_precision(plugin: Precision, sharded: ShardedModel, *, device: torch.device) -> Precision:
    """The plugin to train `sharded` with: `plugin`'s settings, clipping by the global norm and,
    for fp16, an `AgreeingGradScaler` carrying the scaler's settings and scale."""
    new: _GlobalNormClipping
    kind = type(plugin)
    if kind in (MixedPrecision, ZeRO3MixedPrecision):
        assert isinstance(plugin, MixedPrecision)
        scaler = None if plugin.scaler is None else AgreeingGradScaler.like(plugin.scaler, sharded, device=device.type)
        flag: Literal["bf16-mixed", "16-mixed"] = "bf16-mixed" if plugin.precision == "bf16-mixed" else "16-mixed"
        new = ZeRO3MixedPrecision(flag, plugin.device, scaler)
    elif kind in (HalfPrecision, ZeRO3HalfPrecision):
        assert isinstance(plugin, HalfPrecision)
        new = ZeRO3HalfPrecision("bf16-true" if plugin.precision == "bf16-true" else "16-true")
    elif kind in (DoublePrecision, ZeRO3DoublePrecision):
        new = ZeRO3DoublePrecision()
    elif kind in (Precision, ZeRO3Precision):
        new = ZeRO3Precision()
    else:
        raise ValueError(
            f"ZeRO3Strategy does not support the precision plugin {kind.__qualname__}: its gradient clipping "
            f"would see only this rank's shards. Use Trainer(precision=...) with one of '32-true', '16-mixed', "
            f"'bf16-mixed', '16-true', 'bf16-true', '64-true' (or Lightning's plugins for them)."
        )
    new.sharded_model = sharded
    return new


__all__ = ["ZeRO3DoublePrecision", "ZeRO3HalfPrecision", "ZeRO3MixedPrecision", "ZeRO3Precision", "sharded_precision"]
