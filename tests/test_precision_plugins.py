"""The strategy's precision plugins are ordinary module-level classes (precision.py, Note:
explicit precision plugins): they pickle, as a pickled Trainer holds them (Lightning's
test_model_torch_save_ddp_cpu, run under the launcher in test_lightning_torch_saving.py), and
plugin kinds whose clipping would be per shard are refused."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from tests.lit import LitMLP, become_lightning_rank, loader, trainer
from tests.ranks import run_ranks


def _fit_then_torch_save(rank: int, world_size: int) -> dict:
    become_lightning_rank(rank, world_size)
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_zero3 import ZeRO3Strategy

    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    t = trainer(ZeRO3Strategy(), world_size, max_steps=2, plugins=[fp16], gradient_clip_val=0.5)
    t.fit(LitMLP(), loader(world_size))
    plugin_file = io.BytesIO()
    torch.save(t.precision_plugin, plugin_file)  # as a pickled Trainer holds it
    plugin_file.seek(0)
    restored: Any = torch.load(plugin_file, weights_only=False)
    return {"plugin": type(restored).__qualname__, "scaler": type(restored.scaler).__qualname__}


def test_the_precision_plugin_after_fit_pickles() -> None:
    for result in run_ranks(_fit_then_torch_save, 2):
        assert result["plugin"] == "ZeRO3MixedPrecision"
        assert result["scaler"] == "AgreeingGradScaler"


def test_a_precision_plugin_of_another_kind_is_refused_with_the_flags_to_use() -> None:
    from lightning.pytorch.plugins.precision import Precision

    from lightning_zero3.precision import sharded_precision

    class _CustomPrecision(Precision):
        pass

    with pytest.raises(ValueError, match="_CustomPrecision.*'bf16-mixed'"):
        sharded_precision(_CustomPrecision(), None, device=torch.device("cpu"))  # type: ignore[arg-type]
