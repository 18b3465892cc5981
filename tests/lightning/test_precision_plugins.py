"""The strategy's precision plugins are ordinary module-level classes (precision.py, Note:
explicit precision plugins): they pickle, as a pickled Trainer holds them (Lightning's
test_model_torch_save_ddp_cpu, run under the launcher in test_lightning_torch_saving.py), and
plugin kinds whose clipping would be per shard are refused. The fit's ranks are started by the
strategy's launcher (tests/support/adapted.py `launched`)."""

from __future__ import annotations

import io
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, loader, trainer


class _PicklesThePlugin(pl.Callback):
    """After `fit` (its `on_fit_end`, the strategy torn down), the plugin through torch.save and
    torch.load, as a pickled Trainer holds it; what came back, by type."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin_file = io.BytesIO()
        torch.save(trainer.precision_plugin, plugin_file)
        plugin_file.seek(0)
        restored: Any = torch.load(plugin_file, weights_only=False)
        pl_module.restored = {"plugin": type(restored).__qualname__, "scaler": type(restored.scaler).__qualname__}


def test_the_precision_plugin_after_fit_pickles() -> None:
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    callbacks = [_PicklesThePlugin(), HandsBack(restored="lightning_module.restored")]
    fit = trainer(launched("zero3"), 2, max_steps=2, plugins=[fp16], gradient_clip_val=0.5, callbacks=callbacks)
    fit.fit(LitMLP(), loader(2))
    for restored in fit.callback_metrics["restored"]:
        assert restored == {"plugin": "ZeRO3MixedPrecision", "scaler": "AgreeingGradScaler"}


def test_a_precision_plugin_of_another_kind_is_refused_with_the_flags_to_use() -> None:
    from lightning.pytorch.plugins.precision import Precision

    from lightning_zero3.precision import sharded_precision

    class _CustomPrecision(Precision):
        pass

    with pytest.raises(ValueError, match="_CustomPrecision.*'bf16-mixed'"):
        sharded_precision(_CustomPrecision(), None, device=torch.device("cpu"))  # type: ignore[arg-type]
