"""The options both strategies take (Trainer's `ZeRO3Strategy`, Fabric's `ZeRO3FabricStrategy`),
checked once, at construction, with a message that says what was expected and how to fix it, and
the engine both build from them (`build_engine`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal, get_args

import torch
from torch import nn

from lightning_zero3.engine import ShardedModel, ShardingConfig, config_field_names

StateDictType = Literal["sharded", "full"]
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


@dataclass(frozen=True)
class LightningOptions:
    """The options only the Lightning strategies have (the engine's are `ShardingConfig`); the
    README's table says what each does.

    Args:
        state_dict_type: "sharded" (a directory, each rank its shards) or "full" (one file from rank 0).
        trust_checkpoint: unpickle checkpoint files without restriction (checkpoint/trust.py).
        timeout: process-group timeout: a rank that never arrives fails the others after it.
        start_method: "popen" (re-run the script per rank) or a multiprocessing start method.
        async_save: sharded saves write in a background thread (docs/checkpoints.md).
        accumulate_unsharded: micro-batches of `accumulate_grad_batches` Reduce-Scatter once
            (engine/accumulate.py).
    """

    state_dict_type: StateDictType = "sharded"
    trust_checkpoint: bool = False
    timeout: timedelta = timedelta(minutes=30)
    start_method: StartMethod = "popen"
    async_save: bool = False
    accumulate_unsharded: bool = False

    def __post_init__(self) -> None:
        for option, valid, expected in (
            ("state_dict_type", self.state_dict_type in get_args(StateDictType), f"one of {get_args(StateDictType)}"),
            ("trust_checkpoint", isinstance(self.trust_checkpoint, bool), "a bool"),
            (
                "timeout",
                isinstance(self.timeout, timedelta) and self.timeout > timedelta(0),
                "a datetime.timedelta longer than 0 (how long a rank waits for the others, e.g. timedelta(minutes=30))",
            ),
            ("async_save", isinstance(self.async_save, bool), "a bool"),
            ("accumulate_unsharded", isinstance(self.accumulate_unsharded, bool), "a bool"),
            ("start_method", self.start_method in get_args(StartMethod), f"one of {get_args(StartMethod)}"),
        ):
            if not valid:
                raise ValueError(f"LightningOptions({option}=...) must be {expected}; got {getattr(self, option)!r}.")


def split_options(owner: str, arguments: Mapping[str, Any]) -> tuple[ShardingConfig, LightningOptions]:
    """The options among a strategy's `__init__` arguments (its `locals()`: one keyword per field
    of both dataclasses) as the engine's config and the Lightning-only ones, each validated once;
    errors name `owner` (the strategy class) as the constructor the user called."""
    engine_names, lightning_names = config_field_names(ShardingConfig), config_field_names(LightningOptions)
    try:
        config = ShardingConfig(**{k: v for k, v in arguments.items() if k in engine_names})
        lightning = LightningOptions(**{k: v for k, v in arguments.items() if k in lightning_names})
    except ValueError as err:  # "ShardingConfig(prefetch=...) must be ..." -> "ZeRO3Strategy(prefetch=...) ..."
        message = re.sub(r"^(ShardingConfig|LightningOptions)\(", f"{owner}(", str(err))
        raise ValueError(message if message != str(err) else f"{owner}: {err}") from None
    return config, lightning


def build_engine(
    owner: str,
    module: nn.Module,
    config: ShardingConfig,
    *,
    precision: object,
    world_size: int,
    device: torch.device,
    timeout: timedelta | None = None,
) -> ShardedModel:
    """Shard `module` as both strategies do: the gather dtype defaults to what the precision
    plugin implies, and 16-bit compute under a 32-bit plugin is refused before anything changes."""
    narrow = config.param_dtype is not None and config.param_dtype.itemsize < 4
    flag = str(getattr(precision, "precision", ""))
    if narrow and flag in ("32-true", "64-true"):
        raise ValueError(
            f"{owner}(param_dtype={config.param_dtype}) computes in 16 bits, but the precision is {flag}, "
            f"so inputs stay fp32 and the first layer fails on mixed dtypes. Use precision='bf16-mixed' (autocast; "
            f"param_dtype then defaults to bf16) or cast inputs."
        )
    config = replace(
        config,
        param_dtype=config.param_dtype or {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(flag),
        shard_size=config.shard_size if config.shard_size != world_size else None,
    )
    try:
        return ShardedModel(module, config, device=device, timeout=timeout)  # its groups' timeout: ours
    except ValueError as err:  # the engine names its own way to build on meta (engine/materialize.py): add ours
        if "are tensors on the meta device" not in str(err):
            raise
        raise ValueError(
            f"{err} With {owner}: build it in `configure_model()` or under `trainer.init_module(empty_init=True)` "
            f"(Fabric: `fabric.init_module(empty_init=True)`), which defer only parameters too."
        ) from None
