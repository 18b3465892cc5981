"""`ShardingConfig`: every option of the engine, defined and validated once. The strategies
pass on whatever this dataclass declares (common/options.py): a field is added here and nowhere else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from torch import nn

from lightning_zero3.engine.dtypes import parse_dtype
from lightning_zero3.engine.plan import WrapPolicy, validate_wrap_policy

# Elements per scale of the quantized collectives; chosen by measurement (docs/accounting.md,
# Quantized collectives).
DEFAULT_BLOCK = 256


@dataclass(frozen=True)
class Quantization:
    """Bits of the quantized All-Gathers of weights and Reduce-Scatters of gradients (0: exact),
    and elements per scale (quantize.py, Note: quantized collectives)."""

    weights: int = 0
    gradients: int = 0
    block: int = DEFAULT_BLOCK

    def bits(self, kind: str) -> int:
        return self.weights if kind == "weights" else self.gradients


@dataclass(frozen=True)
class ShardingConfig:
    """What the user chose for the engine, validated and normalised (dtype names to dtypes).

    Args:
        wrap_policy: which modules form units (plan.py). None: repeated children of module lists;
            a set of module classes; or ``callable(module) -> bool``.
        prefetch: units All-Gathered ahead of the one computing (0: off).
        persistence_threshold: parameters of at most this many elements stay whole on every rank.
        shard_size: shard within groups of this many consecutive ranks (e.g. one node), replicate across.
        param_dtype: dtype of gathers and compute (e.g. "bf16"). None: the precision's (the
            strategies), else the model's.
        reduce_dtype: dtype of the Reduce-Scatters. None: fp32.
        param_init_fn: initialises a meta module's own tensors. None: ``reset_parameters()``.
        reductions_in_flight: reductions left running in backward. None: 1 on CUDA (as FSDP2), 0 elsewhere.
        rank_checks: steps that check the ranks run alike: "every_step", "first_step" or K (checks.py).
        reshard_after_forward: kept from forward to backward: True shards, False all, G a 1/G slice (reshard.py).
        offload: None, or "host": shards, gradients and optimizer state in host memory (offload.py).
        offload_dir: a directory for the optimizer state in files (disk.py); needs offload="host".
        quantize_weights: True: the weights' All-Gathers send int8 blocks, one scale each (quantize.py).
        quantize_gradients: True or "int8", or "int4": the Reduce-Scatters become all-to-alls of
            quantized blocks, decoded and summed in the reduce dtype, and with shard_size the
            All-Reduces across groups All-Gathers of them (quantize.py).
        quantize_block: elements per scale of the quantized collectives (a multiple of 16).
    """

    wrap_policy: WrapPolicy = None
    prefetch: int = 1
    persistence_threshold: int = 0
    shard_size: int | None = None
    # Given as a dtype or its name ("bf16"), held as a dtype: "given_as" is the type a signature
    # shows (the strategies' signatures, which LightningCLI reads).
    param_dtype: torch.dtype | None = field(default=None, metadata={"given_as": torch.dtype | str | None})
    reduce_dtype: torch.dtype | None = field(default=None, metadata={"given_as": torch.dtype | str | None})
    param_init_fn: Callable[[nn.Module], None] | None = None
    reductions_in_flight: int | None = None
    rank_checks: Literal["every_step", "first_step"] | int = "every_step"
    reshard_after_forward: bool | int = True
    offload: Literal["host"] | None = None
    offload_dir: str | None = None
    quantize_weights: bool = False
    quantize_gradients: bool | Literal["int8", "int4"] = False
    quantize_block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        def bad(option: str, expected: str) -> ValueError:
            return ValueError(f"ShardingConfig({option}=...) must be {expected}; got {getattr(self, option)!r}.")

        def at_least(value: object, least: int) -> bool:
            return type(value) is int and value >= least

        rif, checks, keep = self.reductions_in_flight, self.rank_checks, self.reshard_after_forward
        where = self.offload_dir
        rules = [  # (option, valid, what it must be), checked in this order
            ("prefetch", at_least(self.prefetch, 0), "an int >= 0 (units gathered ahead)"),
            ("persistence_threshold", at_least(self.persistence_threshold, 0), "an int >= 0 (elements)"),
            (
                "reductions_in_flight",
                rif is None or at_least(rif, 0),
                "None (1 on CUDA, 0 elsewhere) or an int >= 0 (Reduce-Scatters left running while backward continues)",
            ),
            (
                "shard_size",
                self.shard_size is None or at_least(self.shard_size, 1),
                "None (whole world) or a positive int that divides the number of ranks, e.g. the devices per node",
            ),
            (
                "rank_checks",
                checks in ("every_step", "first_step") or at_least(checks, 1),
                '"every_step", "first_step" or an int K >= 1 (check every K-th step)',
            ),
            (
                "reshard_after_forward",
                type(keep) is bool or at_least(keep, 2),
                "True (reshard every unit), False "
                "(keep units whole until backward) or an int G >= 2 that divides the shard group (keep a 1/G slice; "
                "for 1 write False)",
            ),
            (
                "offload",
                self.offload in (None, "host"),
                'None (all on the compute device) or "host" (shards, gradients, optimizer state)',
            ),
            (
                "offload_dir",
                where is None or self.offload == "host",
                'None unless offload="host" (the optimizer steps on the CPU): add it',
            ),
            (
                "offload_dir",
                where is None or isinstance(where, str) and os.path.isdir(where),
                "the path (str) of an existing directory, e.g. on a local NVMe disk",
            ),
            ("param_init_fn", self.param_init_fn is None or callable(self.param_init_fn), "callable"),
            ("quantize_weights", type(self.quantize_weights) is bool, "True (int8 All-Gathers of weights) or False"),
            (
                "quantize_gradients",
                self.quantize_gradients in (False, True, "int8", "int4")
                and type(self.quantize_gradients) in (bool, str),
                'False, True or "int8", or "int4"',
            ),
            (
                "quantize_block",
                at_least(self.quantize_block, 16) and self.quantize_block % 16 == 0,
                "an int >= 16, a multiple of 16 (elements per scale)",
            ),
        ]
        for option, valid, expected in rules:
            if not valid:
                raise bad(option, expected)
        if self.quantize_weights and self.shard_size == 1:
            raise ValueError(
                "ShardingConfig(quantize_weights=True with shard_size=1): in groups of one rank every weight is "
                "whole on each rank and no All-Gather sends any (quantize_gradients still quantizes the gradients "
                "crossing between them). Use shard_size >= 2 (e.g. the devices per node) or leave quantize_weights off."
            )
        # Frozen to its users, not to its own constructor.
        object.__setattr__(self, "wrap_policy", validate_wrap_policy(self.wrap_policy))
        object.__setattr__(self, "param_dtype", parse_dtype(self.param_dtype, "ShardingConfig(param_dtype=...)"))
        object.__setattr__(self, "reduce_dtype", parse_dtype(self.reduce_dtype, "ShardingConfig(reduce_dtype=...)"))

    @property
    def quantization(self) -> Quantization:
        """The bits and block of the quantized collectives (quantize.py; 0 bits: exact)."""
        gradients = {False: 0, True: 8, "int8": 8, "int4": 4}[self.quantize_gradients]
        return Quantization(weights=8 * self.quantize_weights, gradients=gradients, block=self.quantize_block)

    def in_flight(self, device_type: str) -> int:
        """`reductions_in_flight` on a device of `device_type`: None is 1 on CUDA, 0 elsewhere."""
        return self.reductions_in_flight if self.reductions_in_flight is not None else int(device_type == "cuda")


def config_field_names(config_type: type[Any]) -> frozenset[str]:
    return frozenset(f.name for f in fields(config_type))


__all__ = ["Quantization", "ShardingConfig", "config_field_names"]
