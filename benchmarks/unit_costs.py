"""CPU time of the engine's own work on one unit, without the model's compute: a gather (All-
Gather, copy-out into the full-parameter block, release) and a reduction (copy-in of full
gradients, Reduce-Scatter, sum and average), on 2 gloo ranks, for each unit of the GPT of
`benchmarks/compare.py` (one block of the 20m model: 3,152,384 parameters).

    python benchmarks/unit_costs.py [--size 20m] [--calls 30] [--rounds 5]
    python benchmarks/unit_costs.py --compare-paths [--calls 10] [--rounds 15]

Prints the median over rounds of the CPU seconds per call (process time: the rank's main thread
and gloo's threads), rank 0, per operation. CPU time is far less sensitive than wall time to
other processes on the machine; run it from two trees to compare engine versions
(`benchmarks/ab_trees.py` does whole steps). `--compare-paths` compares within one process,
alternating round by round, which is steadier under load: a gather sending the row of shards as
it is against one copying the shards into the gather buffer (engine/shard.py, Note: shards in
one row), and the Reduce-Scatter's sum of two rows as one `torch.add(out=)` against a copy then
an add; it prints median (min) per rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_zero3` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.launch import run_ranks
from benchmarks.model import build_model, make_config


def _rank(rank: int, world_size: int, size: str, calls: int, rounds: int) -> dict[str, list[float]]:
    from lightning_zero3.engine import ShardedModel

    model = build_model(make_config(size, 128), seed=0, device=torch.device("cpu"))
    sharded = ShardedModel(model, prefetch=0)
    unit = max(sharded.units, key=lambda u: u.shard_numel)  # a block
    grads = [torch.randn(p.full_shape) for p in unit.params]
    out: dict[str, list[float]] = {"gather": [], "reduce": []}
    sharded.comm.tags.closely = False  # as in steady training: tags checked once per step
    for _ in range(rounds + 1):  # the first round warms the pool up and is dropped
        start = time.process_time()
        for _ in range(calls):
            fulls = unit.gather()
            unit.release(fulls)
        out["gather"].append((time.process_time() - start) / calls)
        start = time.process_time()
        for _ in range(calls):
            unit.finish_reduce(unit.start_reduce(grads))
        out["reduce"].append((time.process_time() - start) / calls)
        sharded.comm.tags.check()
    return {k: v[1:] for k, v in out.items()}


def _compare_paths(rank: int, world_size: int, size: str, calls: int, rounds: int) -> dict[str, list[float]]:
    from lightning_zero3.engine import ShardedModel

    model = build_model(make_config(size, 128), seed=0, device=torch.device("cpu"))
    sharded = ShardedModel(model, prefetch=0)
    unit = max(sharded.units, key=lambda u: u.shard_numel)
    sharded.comm.tags.closely = False
    row = unit._row  # None makes the gather copy the shards (what it did before the row)
    a, b, out = (torch.randn(unit.reduce_row_numel) for _ in range(3))
    variants: dict[str, Any] = {
        "gather, row sent as it is": lambda: unit.release(unit.gather()),
        "gather, shards copied": lambda: unit.release(unit.gather()),
        "sum, add(out=)": lambda: torch.add(a, b, out=out),
        "sum, copy then add": lambda: out.copy_(a).add_(b),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for k in range(rounds + 1):  # round 0 warms up
        names = list(variants) if k % 2 == 0 else list(reversed(variants))
        for name in names:
            unit._row = None if name == "gather, shards copied" else row
            start = time.process_time()
            for _ in range(calls):
                variants[name]()
            if k:
                times[name].append((time.process_time() - start) / calls)
        sharded.comm.tags.check()
    unit._row = row
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="20m")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compare-paths", action="store_true", help="A/B within one process (see above)")
    args = p.parse_args(argv)
    if args.compare_paths:
        ranks: list[Any] = run_ranks(_compare_paths, 2, args.size, args.calls, args.rounds)
        for name in ranks[0]:
            cells = [f"{statistics.median(r[name]) * 1e3:.3f} ({min(r[name]) * 1e3:.3f})" for r in ranks]
            print(f"{name:<28} CPU ms per call, median (min), rank 0 / rank 1: {' / '.join(cells)}")
        return
    results: list[Any] = run_ranks(_rank, 2, args.size, args.calls, args.rounds)
    for op, values in results[0].items():
        rounds = ", ".join(f"{v * 1e3:.2f}" for v in values)
        print(f"{op}: {statistics.median(values) * 1e3:.2f} ms CPU per call (rounds {rounds})")


if __name__ == "__main__":
    main()
