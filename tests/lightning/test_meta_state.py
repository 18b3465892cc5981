"""Building under the strategy's meta contexts (`trainer.init_module(empty_init=True)`,
`configure_model`) defers only parameters: buffers and plain tensor state such as torchmetrics'
metric states come out real (engine/materialize.py, Note: only parameters on meta)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_zero3.common.options import build_engine
from lightning_zero3.engine import ShardedModel, ShardingConfig
from lightning_zero3.engine.materialize import parameters_on_meta
from tests.support import fabric_helpers
from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, dataset, loader, trainer
from tests.support.ranks import run_ranks

TOL = 1e-5


class _WithState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6)))
        self.max_seen = torchmetrics.MaxMetric()  # state default -inf, a plain attribute


def test_parameters_are_deferred_and_every_other_tensor_keeps_its_value() -> None:
    with parameters_on_meta("cpu"):
        module = _WithState()
    assert all(p.is_meta for p in module.parameters())
    assert module.head.weight is module.embed.weight
    assert torch.allclose(module.inv_freq, 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6)))
    assert module.max_seen.max_value.item() == -math.inf
    assert module.max_seen._defaults["max_value"].item() == -math.inf
    module.max_seen.update(torch.tensor(3.0))
    assert module.max_seen.compute().item() == 3.0
    module.max_seen.reset()  # from `_defaults`
    assert module.max_seen.max_value.item() == -math.inf


def test_the_parameter_hook_is_gone_after_the_block() -> None:
    with parameters_on_meta("cpu"):
        pass
    assert not nn.Linear(2, 2).weight.is_meta


def _shard_built_under_plain_meta(rank: int, world_size: int) -> str:
    with torch.device("meta"):
        module = _WithState()
    try:
        ShardedModel(module, device="cpu")
    except ValueError as err:
        return str(err)
    return "no error"


def test_metric_state_left_on_meta_by_a_plain_meta_device_is_refused_on_every_rank() -> None:
    for message in run_ranks(_shard_built_under_plain_meta, 2):
        assert "max_seen.max_value" in message and "materialize.parameters_on_meta(device)" in message, message
        assert "init_module" not in message  # the engine knows no Lightning


def test_the_strategies_refusal_of_metric_state_on_meta_names_lightnings_ways() -> None:
    with torch.device("meta"):
        module = _WithState()
    with pytest.raises(ValueError, match=r"max_seen.max_value.* With ZeRO3FabricStrategy: build it in "
                       r"`configure_model\(\)` or under `trainer.init_module\(empty_init=True\)`"):  # fmt: skip
        build_engine("ZeRO3FabricStrategy", module, ShardingConfig(), precision=None, world_size=1, device="cpu")


class _ScaledLinear(nn.Linear):
    """A module with both a parameter and a buffer that `reset_parameters()` does not write."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))


def _shard_scaled(rank: int, world_size: int) -> list[float]:
    with parameters_on_meta("cpu"):
        module = nn.Sequential(_ScaledLinear(), _ScaledLinear())
    ShardedModel(module, device="cpu")
    return [float(v) for layer in module for v in layer.scale]


def test_sharding_materialises_only_the_meta_tensors_of_a_module() -> None:
    for scales in run_ranks(_shard_scaled, 2):
        assert scales == [0.5] * 8


class _LitMetrics(LitMLP):
    def __init__(self) -> None:
        super().__init__()
        self.mae = torchmetrics.MeanAbsoluteError()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.mae.update(self(x), y)
        self.log("val_mae", self.mae, sync_dist=True)


class _ExpectedAtRest(pl.Callback):
    """After `validate`, the module at rest: the MAE of a forward over the whole dataset (every
    rank gathers), kept on the module."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        x, y = dataset().tensors
        with torch.no_grad():
            pl_module.expected = float(F.l1_loss(pl_module(x), y))


def test_init_module_empty_init_with_a_torchmetrics_attribute_validates_exactly() -> None:
    hands_back = HandsBack(mae="callback_metrics.val_mae", expected="lightning_module.expected")
    t = trainer(launched("zero3"), 2, callbacks=[_ExpectedAtRest(), hands_back])
    with t.init_module(empty_init=True):
        model = _LitMetrics()
    t.validate(model, loader(2))
    for mae, expected in zip(t.callback_metrics["mae"], t.callback_metrics["expected"], strict=True):
        assert abs(float(mae) - expected) < TOL


class _WithComputedBuffer(nn.Module):
    """A buffer computed in `__init__` (as a rotary `inv_freq`), which nothing re-creates."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(1.0, 5.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _buffer_after_fabric_empty_init(fabric: Any) -> tuple[list[float], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fabric.init_module(empty_init=True):
            model = _WithComputedBuffer()
        model = fabric.setup(model)
    return model.module.scale.tolist(), [str(w.message) for w in caught if "meta device" in str(w.message)]


def test_fabric_init_module_empty_init_keeps_the_values_of_buffers_computed_in_init() -> None:
    """Fabric's `init_module(empty_init=True)` defers only parameters, as the Trainer's does
    (engine/materialize.py, Note: only parameters on meta)."""
    scale, warned = fabric_helpers.launch(_buffer_after_fabric_empty_init)
    assert scale == [1.0, 2.0, 3.0, 4.0]
    assert warned == []
