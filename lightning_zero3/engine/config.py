"""`ShardingConfig`: every option of the engine, defined and validated once. The strategies
pass on whatever this dataclass declares (options.py): a field is added here and nowhere else.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from lightning_zero3.engine.dtypes import parse_dtype
from lightning_zero3.engine.plan import WrapPolicy, validate_wrap_policy


@dataclass(frozen=True)
class ShardingConfig:
    """What the user chose for the engine, validated and normalised (dtype names to dtypes).

    Args:
        wrap_policy: which modules form units. None: each repeated child of an
            ``nn.ModuleList``/``nn.Sequential`` holding parameters; a set of module classes; or
            ``callable(module) -> bool``.
        prefetch: units All-Gathered ahead of the one computing (0: off).
        persistence_threshold: parameters of at most this many elements stay whole on every rank.
        shard_size: shard within groups of this many consecutive ranks (e.g. one node) and
            replicate across them. None: the whole world.
        param_dtype: dtype of gathers and compute (e.g. "bf16"). None: the precision's (the
            strategies), else the model's.
        reduce_dtype: dtype of the Reduce-Scatters. None: fp32.
        param_init_fn: initialises one module's own tensors built on the meta device. None:
            ``reset_parameters()``.
        reductions_in_flight: reductions left running while backward continues (reduce.py).
            None: 2 on CUDA, 0 elsewhere.
        rank_checks: steps on which ranks running different units raise `OrderMismatchError`
            (checks.py, Note: rank check modes): "every_step", "first_step", or an int K.
        reshard_after_forward: what a unit keeps from forward to backward (reshard.py): True its
            shards, False its full parameters, an int G its 1/G slice.
        offload: None, or "host": shards, gradients and optimizer state in host memory, the step
            on the CPU (offload.py).
        offload_dir: a directory for the optimizer state in files (disk.py); needs offload="host".
    """

    wrap_policy: WrapPolicy = None
    prefetch: int = 1
    persistence_threshold: int = 0
    shard_size: int | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    reductions_in_flight: int | None = None
    rank_checks: str | int = "every_step"
    reshard_after_forward: bool | int = True
    offload: str | None = None
    offload_dir: str | None = None

    def __post_init__(self) -> None:
        def bad(option: str, expected: str) -> ValueError:
            return ValueError(f"ShardingConfig({option}=...) must be {expected}; got {getattr(self, option)!r}.")

        if type(self.prefetch) is not int or self.prefetch < 0:
            raise bad("prefetch", "an int >= 0 (units gathered ahead)")
        if type(self.persistence_threshold) is not int or self.persistence_threshold < 0:
            raise bad("persistence_threshold", "an int >= 0 (elements)")
        if self.reductions_in_flight is not None and (
            type(self.reductions_in_flight) is not int or self.reductions_in_flight < 0
        ):
            raise bad(
                "reductions_in_flight",
                "None (2 on CUDA, 0 elsewhere) or an int >= 0 (Reduce-Scatters left running while backward continues)",
            )
        if self.shard_size is not None and (type(self.shard_size) is not int or self.shard_size < 1):
            raise bad(
                "shard_size",
                "None (whole world) or a positive int that divides the number of ranks, e.g. the devices per node",
            )
        checks = self.rank_checks
        if checks not in ("every_step", "first_step") and (type(checks) is not int or checks < 1):
            raise bad("rank_checks", '"every_step", "first_step" or an int K >= 1 (check every K-th step)')
        keep = self.reshard_after_forward
        if type(keep) is not bool and (type(keep) is not int or keep < 2):
            raise bad(
                "reshard_after_forward",
                "True (reshard every unit), False (keep units whole until backward) or an int G >= 2 "
                "that divides the shard group (keep a 1/G slice; for 1 write False)",
            )
        if self.offload not in (None, "host"):
            raise bad("offload", 'None (all on the compute device) or "host" (shards, gradients, optimizer state)')
        if self.offload_dir is not None:
            if self.offload != "host":
                raise bad("offload_dir", 'None unless offload="host" (the optimizer steps on the CPU): add it')
            if not isinstance(self.offload_dir, str) or not os.path.isdir(self.offload_dir):
                raise bad("offload_dir", "the path (str) of an existing directory, e.g. on a local NVMe disk")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise bad("param_init_fn", "callable")
        # Frozen to its users, not to its own constructor.
        object.__setattr__(self, "wrap_policy", validate_wrap_policy(self.wrap_policy))
        object.__setattr__(self, "param_dtype", parse_dtype(self.param_dtype, "ShardingConfig(param_dtype=...)"))
        object.__setattr__(self, "reduce_dtype", parse_dtype(self.reduce_dtype, "ShardingConfig(reduce_dtype=...)"))

    @property
    def check_every(self) -> int | None:
        """`rank_checks` as `RankChecks(every=...)` takes it."""
        if self.rank_checks == "every_step":
            return 1
        return None if self.rank_checks == "first_step" else int(self.rank_checks)


def config_field_names(config_type: type[Any]) -> frozenset[str]:
    return frozenset(f.name for f in fields(config_type))


__all__ = ["ShardingConfig", "config_field_names"]
