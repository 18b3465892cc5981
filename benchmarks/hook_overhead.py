"""Python bookkeeping of the engine's hooks per training step, as the number of units grows.

    python benchmarks/hook_overhead.py --units 12 48 --steps 60

One process (a gloo group of one rank: no collective runs) and a chain of tiny Linear(8, 8)
units, so that compute is negligible and the step time is mostly the hooks' own work. For each
size it prints the median time of a training step (forward, backward, optimizer step) of the
sharded model and of the same model unsharded, the difference per unit, and two counts per step
read from the engine's own objects: how often a unit's "gather in flight" flag was read and how
often a slot's open-forward count (`Slot.depth`) was read. Walking every unit on every event
makes both grow with units squared; keeping a set of live units and a count of open slots
makes them grow with units.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.calls import Slot
from lightning_zero3.engine.unit import Unit


class Chain(nn.Module):
    """`units` Linear(8, 8) blocks; the root keeps a parameter of its own (a root unit)."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * self.scale


class _Counter:
    flag_reads = 0
    depth_reads = 0


class _CountedFlag:
    """Stands in for `Unit.gather_in_flight`, counting reads."""

    def __init__(self, original: property) -> None:
        self.original = original

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        _Counter.flag_reads += 1
        return self.original.__get__(obj, owner)


class _CountedDepth:
    """Stands in for the `Slot.depth` slot, counting reads."""

    def __init__(self, member: Any) -> None:
        self.member = member

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        _Counter.depth_reads += 1
        return self.member.__get__(obj, owner)

    def __set__(self, obj: Any, value: Any) -> None:
        self.member.__set__(obj, value)


def _steps(model: nn.Module, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[steps // 5 :]  # the first steps record the order and warm up


def measure(units: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    plain = Chain(units)
    sharded_module = copy.deepcopy(plain)
    ShardedModel(sharded_module, prefetch=1)
    plain_s = statistics.median(_steps(plain, steps))
    sharded_s = statistics.median(_steps(sharded_module, steps))
    flag, depth = Unit.__dict__["gather_in_flight"], Slot.__dict__["depth"]
    _Counter.flag_reads = _Counter.depth_reads = 0
    setattr(Unit, "gather_in_flight", _CountedFlag(flag))  # noqa: B010
    setattr(Slot, "depth", _CountedDepth(depth))  # noqa: B010
    try:
        _steps(sharded_module, 5)  # the order is recorded already: every step alike
    finally:
        setattr(Unit, "gather_in_flight", flag)  # noqa: B010
        setattr(Slot, "depth", depth)  # noqa: B010
    counted_steps = 5
    return {
        "units": units,
        "plain_ms": plain_s * 1e3,
        "sharded_ms": sharded_s * 1e3,
        "overhead_us_per_unit": (sharded_s - plain_s) / units * 1e6,
        "flag_reads_per_step": _Counter.flag_reads / counted_steps,
        "depth_reads_per_step": _Counter.depth_reads / counted_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, nargs="+", default=[12, 48])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            rows = [measure(units, args.steps) for units in args.units]
        finally:
            dist.destroy_process_group()
    print(f"{'units':>5} {'plain ms':>9} {'zero3 ms':>9} {'us/unit':>8} {'flag reads':>11} {'depth reads':>12}")
    for r in rows:
        print(
            f"{r['units']:>5} {r['plain_ms']:>9.2f} {r['sharded_ms']:>9.2f} {r['overhead_us_per_unit']:>8.1f} "
            f"{r['flag_reads_per_step']:>11.0f} {r['depth_reads_per_step']:>12.0f}"
        )


if __name__ == "__main__":
    main()
