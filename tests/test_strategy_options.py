"""`ZeRO3Strategy` keeps its options in `strategy.options` (as `ZeRO3FabricStrategy` does); each
option is also a public attribute of the same name that reads the option and, when assigned,
replaces it validated as the constructor validates it."""

from __future__ import annotations

from dataclasses import fields
from datetime import timedelta

import pytest
import torch
from torch import nn

from lightning_zero3 import ZeRO3Strategy
from lightning_zero3.options import ShardingOptions


def _init(module: nn.Module) -> None:
    pass


CHOSEN = {
    "wrap_policy": {nn.Linear},
    "prefetch": 2,
    "persistence_threshold": 7,
    "shard_size": 2,
    "param_dtype": "bf16",
    "reduce_dtype": torch.float64,
    "param_init_fn": _init,
    "state_dict_type": "full",
    "trust_checkpoint": True,
    "timeout": timedelta(minutes=3),
    "start_method": "spawn",
    "reductions_in_flight": 1,
    "cpu_transport": "shared_memory",
}
NORMALISED = {**CHOSEN, "param_dtype": torch.bfloat16}


def test_every_option_reads_back_under_its_public_name_and_in_options() -> None:
    assert set(CHOSEN) == {f.name for f in fields(ShardingOptions)}  # a new option is tested too
    strategy = ZeRO3Strategy(**CHOSEN)
    for name, value in NORMALISED.items():
        assert getattr(strategy, name) == value, name
        assert getattr(strategy.options, name) == value, name


def test_assigning_an_option_replaces_it_in_options() -> None:
    strategy = ZeRO3Strategy()
    strategy.state_dict_type = "full"
    strategy.prefetch = 3
    strategy.reduce_dtype = "bf16"
    assert (strategy.options.state_dict_type, strategy.options.prefetch) == ("full", 3)
    assert strategy.reduce_dtype is strategy.options.reduce_dtype is torch.bfloat16


def test_assigning_a_bad_option_raises_the_constructors_error_and_keeps_the_old_value() -> None:
    strategy = ZeRO3Strategy(prefetch=2)
    with pytest.raises(ValueError, match=r"ZeRO3Strategy\(prefetch=...\)"):
        strategy.prefetch = -1
    with pytest.raises(ValueError, match=r"ZeRO3Strategy\(state_dict_type=...\)"):
        strategy.state_dict_type = "consolidated"
    assert strategy.prefetch == 2 and strategy.state_dict_type == "sharded"
