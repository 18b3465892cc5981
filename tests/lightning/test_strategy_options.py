"""Both strategies take every option once, as keyword arguments, and split them into the engine's
`ShardingConfig` (`strategy.config`, handed to the engine whole) and the Lightning-only
`LightningOptions` (`strategy.lightning_options`); each is validated once, with an error that
names the strategy class the user called, the option and the fix."""

from __future__ import annotations

import dataclasses
import tempfile
from datetime import timedelta

import pytest
import torch
from torch import nn

from lightning_zero3 import ZeRO3FabricStrategy, ZeRO3Strategy
from lightning_zero3.common.options import LightningOptions
from lightning_zero3.engine import ShardingConfig

STRATEGIES = [ZeRO3Strategy, ZeRO3FabricStrategy]


def _init(module: nn.Module) -> None:
    pass


ENGINE = {
    "wrap_policy": {nn.Linear},
    "prefetch": 2,
    "persistence_threshold": 7,
    "shard_size": 2,
    "param_dtype": "bf16",
    "reduce_dtype": torch.float64,
    "param_init_fn": _init,
    "reductions_in_flight": 1,
    "rank_checks": 5,
    "reshard_after_forward": False,
    "offload": "host",
    "offload_dir": tempfile.gettempdir(),
    "quantize_weights": True,
    "quantize_gradients": "int4",
    "quantize_block": 128,
}
LIGHTNING = {
    "state_dict_type": "full",
    "trust_checkpoint": True,
    "timeout": timedelta(minutes=3),
    "start_method": "spawn",
    "async_save": True,
    "accumulate_unsharded": True,
}


@pytest.mark.parametrize("cls", STRATEGIES)
def test_every_option_lands_in_config_or_lightning_options_normalised(cls: type) -> None:
    # A field added to either dataclass must be added here too.
    assert set(ENGINE) == {f.name for f in dataclasses.fields(ShardingConfig)}
    assert set(LIGHTNING) == {f.name for f in dataclasses.fields(LightningOptions)}
    lightning = LIGHTNING if cls is ZeRO3Strategy else {**LIGHTNING, "accumulate_unsharded": False}  # Trainer only
    strategy = cls(**ENGINE, **lightning)
    assert strategy.config == ShardingConfig(**{**ENGINE, "param_dtype": torch.bfloat16})
    assert strategy.config.param_dtype is torch.bfloat16
    assert strategy.lightning_options == LightningOptions(**lightning)


@pytest.mark.parametrize("cls", STRATEGIES)
def test_an_unknown_option_is_a_type_error_naming_it(cls: type) -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'prefech'"):
        cls(prefech=2)


def test_fabric_refuses_accumulate_unsharded_naming_no_backward_sync() -> None:
    with pytest.raises(ValueError, match=r"^ZeRO3FabricStrategy\(accumulate_unsharded=True\) is for the Trainer's .*"
                       r"`with fabric.no_backward_sync\(model\):`"):  # fmt: skip
        ZeRO3FabricStrategy(accumulate_unsharded=True)


@pytest.mark.parametrize("cls", STRATEGIES)
@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("prefetch", -1, "an int >= 0"),
        ("param_dtype", "int8", "a floating torch.dtype"),
        ("shard_size", 0, "None .whole world. or a positive int"),
        ("offload", "cpu", 'None .all on the compute device. or "host"'),
        ("state_dict_type", "consolidated", "one of"),
        ("timeout", 30, "a datetime.timedelta"),
        ("timeout", timedelta(0), r"a datetime.timedelta longer than 0 .* got datetime.timedelta\(0\)"),
        ("timeout", timedelta(seconds=-5), "a datetime.timedelta longer than 0"),
        ("accumulate_unsharded", "yes", "a bool"),
    ],
)
def test_a_bad_option_names_the_strategy_class_and_the_option(cls: type, option: str, value: object, expected: str):
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\({option}=...\) must be {expected}"):
        cls(**{option: value})


def test_replacing_an_option_validates_it_again() -> None:
    strategy = ZeRO3Strategy(prefetch=2)
    strategy.lightning_options = dataclasses.replace(strategy.lightning_options, state_dict_type="full")
    assert strategy.lightning_options.state_dict_type == "full"
    with pytest.raises(ValueError, match=r"ShardingConfig\(prefetch=...\) must be an int >= 0"):
        dataclasses.replace(strategy.config, prefetch=-1)
    assert strategy.config.prefetch == 2
