"""What one rank will hold and send under ZeRO-3, before anything is launched: `python -m
lightning_zero3 estimate` and `estimate(...)`. DeepSpeed's `estimate_zero3_model_states_mem_needs_*`
gives model-state memory only; this adds the gathered units alive during a pass and the bytes each
collective carries per step, from the same unit plan the engine builds (engine/plan.py).

    python -m lightning_zero3 estimate my_pkg.models:build_model --world-size 8 --param-dtype bf16
    python -m lightning_zero3 estimate --params 7e9 --units 32 --world-size 8

[Note: what the estimate counts]
Model state between steps, live units and payload per step by the engine's own rules on unit
sizes; row padding left out, under 1% (docs/design.md, what the estimate counts).
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from lightning_zero3.engine import (
    ShardingConfig,
    UnitSizes,
    live_peak,
    make_plan,
    resolve,
    sent_row_bytes,
    step_bytes,
)

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
# The engine options the command takes, named, defaulted, documented and validated by ShardingConfig.
OPTIONS = (
    "shard_size",
    "prefetch",
    "param_dtype",
    "reduce_dtype",
    "reshard_after_forward",
    "reductions_in_flight",
    "persistence_threshold",
    "quantize_weights",
    "quantize_gradients",
    "quantize_block",
)


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank (memory) and per training step (payload), see Note: what the estimate counts."""

    world_size: int
    shard_group: int
    parameters: int
    gradients: int
    optimizer_states: int
    live_units: int
    all_gather: int
    reduce_scatter: int
    all_reduce: int
    all_reduce_across_groups: int
    all_gather_in_groups: int = 0  # reshard_after_forward=G: the backward's, inside groups of G
    all_gather_across_groups: int = 0  # quantize_gradients with shard groups: the packed reduced rows
    slice_group: int = 1
    unsynced_sums: int = 0  # whole gradients summed while sync is off (accumulate.py)
    offloaded_to_host: int = 0  # of the model state: shards, gradients, optimizer state (offload.py)
    offloaded_to_disk: int = 0  # of the model state: optimizer state in files (disk.py)
    device_copy: int = 0  # with offload: the device's copy of the shards, in the gather dtype

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def on_device(self) -> int:
        """Bytes on the compute device between steps (model state not offloaded, the shards' copy)."""
        return self.model_state - self.offloaded_to_host - self.offloaded_to_disk + self.device_copy

    @property
    def sent_per_rank(self) -> float:
        g, r = self.shard_group, self.world_size // self.shard_group
        ring = (g - 1) / g * (self.all_gather + self.reduce_scatter) + 2 * (self.world_size - 1) / self.world_size * (
            self.all_reduce
        )
        inside = (self.slice_group - 1) / self.slice_group * self.all_gather_in_groups
        across = 2 * self.all_reduce_across_groups + self.all_gather_across_groups
        return ring + inside + ((r - 1) / r * across if r > 1 else 0.0)

    def table(self) -> str:
        in_groups = [(f"All-Gather in groups of {self.slice_group} / step", self.all_gather_in_groups)]
        rows = [
            ("parameters (shards)", self.parameters),
            ("gradients (shards)", self.gradients),
            ("optimizer state", self.optimizer_states),
            ("model state, between steps", self.model_state),
            *[("  of it in host memory (offload)", self.offloaded_to_host)] * bool(self.offloaded_to_host),
            *[("  of it on disk (offload_dir)", self.offloaded_to_disk)] * bool(self.offloaded_to_disk),
            *[("on the device between steps", self.on_device)] * bool(self.device_copy),
            ("live units, peak in a pass", self.live_units),
            *[("unsynced gradient sums", self.unsynced_sums)] * bool(self.unsynced_sums),
            ("All-Gather payload / step", self.all_gather),
            *in_groups * (self.slice_group > 1),
            ("Reduce-Scatter payload / step", self.reduce_scatter),
            *[("All-Gather across groups / step", self.all_gather_across_groups)] * bool(self.all_gather_across_groups),
            ("All-Reduce payload / step", self.all_reduce + self.all_reduce_across_groups),
            ("sent by each rank / step (ring)", round(self.sent_per_rank)),
        ]
        head = f"ZeRO-3 estimate, {self.world_size} ranks, shards over groups of {self.shard_group}, per rank:"
        return "\n".join([head, *(f"  {name:<34} {_human(value):>12}" for name, value in rows)])


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def estimate_units(
    unit_params: list[list[int]],
    *,
    world_size: int,
    persistent: Sequence[int] = (),
    config: ShardingConfig | None = None,
    master_dtype: torch.dtype = torch.float32,
    optimizer_states: int = 2,
    trainable: bool = True,
    micro_batches: int = 1,
    no_sync: bool = False,
) -> Estimate:
    """The estimate from each unit's parameter sizes (root first, then the units in forward
    order) and the whole parameters' sizes, per optimizer step of `micro_batches` (`no_sync`:
    all but the last without gradient sync)."""
    config = config or ShardingConfig()
    g = config.shard_size or world_size
    if world_size % g:
        raise ValueError(f"shard_size={g} must divide the world size {world_size}.")
    master = master_dtype.itemsize
    gather = (config.param_dtype or master_dtype).itemsize
    reduce = (config.reduce_dtype or torch.float32).itemsize
    reshard = resolve(config.reshard_after_forward, shard_group=g)
    rows = [sum(math.ceil(n / g) for n in params) for params in unit_params]  # elements each rank keeps
    shard_elements = sum(rows) + sum(persistent)
    parameters = shard_elements * master
    unit_numels = [sum(params) for params in unit_params]
    ends = [i in (0, len(rows) - 1) for i in range(len(rows))]  # the root and the last unit
    quantized = config.quantization if g > 1 else replace(config.quantization, weights=0, gradients=0)

    def row(r: int, itemsize: int, kind: str) -> int:  # one row as sent (the check slot, padding left out)
        return sent_row_bytes(r, itemsize, data=r, bits=quantized.bits(kind), block=quantized.block)

    across_packed = bool(config.quantization.gradients) and g < world_size  # quantize.py, Note: quantized collectives

    def across(r: int) -> int:  # one reduced row as it crosses the groups, packed
        return sent_row_bytes(r, reduce, data=r, bits=config.quantization.gradients, block=quantized.block)

    units = [
        UnitSizes(
            gather=g * row(r, gather, "weights"),
            reduce=g * row(r, reduce, "gradients") * trainable,
            reduced=(world_size // g * across(r) if across_packed else r * reduce) * trainable,
            slice_gather=g * r * gather,
            backward=trainable,
            ends_forward=end,
        )
        for r, end in zip(rows, ends)
    ]
    synced = 1 if no_sync else micro_batches
    whole = sum(persistent) * reduce if trainable and world_size > 1 else 0  # persistent parameters: All-Reduced
    sent = step_bytes(
        units,
        reshard,
        persistent=whole,
        micro_batches=micro_batches,
        synced=synced,
        across="all_gather" if across_packed else "all_reduce",
    )
    in_flight = config.in_flight("cuda")
    largest = max(unit_numels, default=0)
    live = live_peak([n * gather for n in unit_numels], reshard, prefetch=config.prefetch, ends_forward=ends)
    live += largest * gather + (in_flight + 1) * largest * reduce
    sharded = sum(rows) * master * (1 + trainable * (1 + optimizer_states))  # shards, gradients, state
    on_disk = sum(rows) * master * optimizer_states * trainable if config.offload_dir is not None else 0
    return Estimate(
        world_size=world_size,
        shard_group=g,
        parameters=parameters,
        gradients=parameters if trainable else 0,
        optimizer_states=optimizer_states * parameters if trainable else 0,
        live_units=live,
        all_gather=sent["shard"]["all_gather"] if world_size > 1 else 0,
        reduce_scatter=sent["shard"]["reduce_scatter"] if g > 1 else 0,
        all_reduce=sent["shard"].get("all_reduce", 0),
        all_reduce_across_groups=sent["across"].get("all_reduce", 0) if g < world_size else 0,
        all_gather_across_groups=sent["across"].get("all_gather", 0) if g < world_size else 0,
        all_gather_in_groups=sent["slices"]["all_gather"],
        slice_group=reshard if type(reshard) is int else 1,
        unsynced_sums=sum(unit_numels) * max(reduce, 4) * trainable if no_sync and micro_batches > 1 else 0,
        offloaded_to_host=sharded - on_disk if config.offload is not None else 0,
        offloaded_to_disk=on_disk,
        device_copy=sum(rows) * gather if config.offload is not None else 0,
    )


def estimate(
    module: nn.Module,
    *,
    world_size: int,
    config: ShardingConfig | None = None,
    optimizer_states: int = 2,
    micro_batches: int = 1,
    no_sync: bool = False,
) -> Estimate:
    """The estimate for `module` (build it on the meta device: nothing is allocated), with the
    units the engine would pick. Unit order is module order, the forward order of most models."""
    config = config or ShardingConfig()
    plan = make_plan(
        module, config.wrap_policy, config.persistence_threshold, shard_group_size=config.shard_size or world_size
    )
    units = [[entry.param.numel() for entry in unit.params] for unit in plan.units]
    dtypes = {p.dtype for p in module.parameters()}
    return estimate_units(
        units,
        world_size=world_size,
        persistent=[entry.param.numel() for entry in plan.persistent],
        config=config,
        master_dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32,
        optimizer_states=optimizer_states,
        trainable=any(p.requires_grad for p in module.parameters()),
        micro_batches=micro_batches,
        no_sync=no_sync,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="MODULE:CALLABLE returning the nn.Module (built on the meta device)")
    parser.add_argument("--params", type=float, help="instead of a model: the parameter count, e.g. 7e9")
    parser.add_argument("--units", type=int, default=1, help="with --params: equal units (e.g. transformer blocks)")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks")
    documented = dict(re.findall(r"^ {8}(\w+): (.+?)(?=^ {8}\w+: |\Z)", ShardingConfig.__doc__ or "", re.M | re.S))
    for option in (f for f in fields(ShardingConfig) if f.name in OPTIONS):
        help = " ".join(documented[option.name].split()) + f" (ShardingConfig; default {option.default})"
        parser.add_argument(f"--{option.name.replace('_', '-')}", type=parse_option, default=option.default, help=help)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    parser.add_argument("--accumulate", type=int, default=1, metavar="K", help="micro-batches per optimizer step")
    parser.add_argument("--no-sync", action="store_true", help="with --accumulate: reduce once per optimizer step")
    parser.add_argument(
        "--offload",
        choices=("none", "host", "disk"),
        default="none",
        help="host: shards, gradients, optimizer state in host memory; disk: the optimizer state in files too",
    )


def parse_option(text: str) -> bool | int | str | None:
    """A command line's value of a ShardingConfig option: true, false, none, an int, else the
    text (a dtype's name); ShardingConfig validates it."""
    named = {"true": True, "false": False, "none": None}
    return named[text.lower()] if text.lower() in named else int(text) if text.isdigit() else text


def run(args: argparse.Namespace) -> str:
    """The table for the parsed command line; `ValueError` for a bad combination."""
    config = ShardingConfig(
        **{name: getattr(args, name) for name in OPTIONS},
        offload=None if args.offload == "none" else "host",
        offload_dir="." if args.offload == "disk" else None,  # the run's own; any existing directory stands in
    )
    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
    if args.accumulate < 1:
        raise ValueError(f"--accumulate must be at least 1, got {args.accumulate}")
    passes = {"micro_batches": args.accumulate, "no_sync": args.no_sync}
    states = OPTIMIZER_STATES[args.optimizer]
    if (args.model is None) == (args.params is None):
        raise ValueError("give either a model (MODULE:CALLABLE) or --params with --units, not both or neither")
    if args.params is not None:
        if args.units < 1 or args.params < args.units:
            raise ValueError(f"--params ({args.params:g}) must be at least --units ({args.units}), which must be >= 1")
        each = int(args.params) // args.units
        units = [[0], *([each] for _ in range(args.units))]
        result = estimate_units(units, world_size=args.world_size, config=config, optimizer_states=states, **passes)
    else:
        module_name, _, attr = args.model.partition(":")
        if not attr:
            raise ValueError(f"the model must be given as MODULE:CALLABLE, e.g. my_pkg.models:build; got {args.model}")
        build = getattr(importlib.import_module(module_name), attr)
        with torch.device("meta"):
            module = build()
        result = estimate(module, world_size=args.world_size, config=config, optimizer_states=states, **passes)
    return result.table()


__all__ = ["Estimate", "estimate", "estimate_units", "parse_option"]
