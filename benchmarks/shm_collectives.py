"""CPU and wall time of one unit's All-Gather and Reduce-Scatter on 2 CPU ranks, through gloo
(the engine's in-place broadcasts and send/recv: lightning_zero3/engine/comm.py, Note: gloo) and
through a shared-memory file (lightning_zero3/engine/shm.py, Note: shared-memory transport).

Two levels, each timed for both transports, alternating round by round in one process:
- `collective`: `Comm.all_gather` of one row per rank (the row sent as it is, as the engine
  does) and `Comm.reduce_scatter` of the (N, chunk) full gradient (sum in rank order);
- `unit`: what the engine does per unit, on a block of the 20m GPT of `benchmarks/compare.py`
  (3,152,384 parameters): `Unit.gather` + `release` (All-Gather, copy-out into the
  full-parameter block) and `start_reduce` + `finish_reduce` (copy-in of full gradients,
  Reduce-Scatter, sum, average).
Per call: process CPU time (the main thread and gloo's threads), main-thread CPU time and wall
time; the median over rounds of the mean of `--calls` calls, per rank.

    python benchmarks/shm_collectives.py [--size 20m] [--calls 10] [--rounds 9]
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

CLOCKS = ("cpu", "thread", "wall")


def _rank(rank: int, world_size: int, size: str, calls: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    import torch.distributed as dist

    from lightning_zero3.engine import ShardedModel

    model = build_model(make_config(size, 128), seed=0, device=torch.device("cpu"))
    sharded = ShardedModel(model, prefetch=0, cpu_transport="shared_memory")  # the arena sized as in training
    comm = sharded.comm
    comm.tags.closely = False  # as in steady training: tags checked once per step
    unit = max(sharded.units, key=lambda u: u.shard_numel)  # a block
    n, row, chunk = world_size, unit.row_numel(), unit.reduce_row_numel
    arena = comm.shared
    grads = [torch.randn(p.full_shape) for p in unit.params]
    own, recv = torch.randn(row), torch.empty(n, row)
    full, out = torch.randn(n, chunk), torch.empty(chunk)
    ops: dict[str, Any] = {
        "collective: All-Gather": lambda: comm.all_gather(recv, own, async_op=False, what="b", fill_own_row=False),
        "collective: Reduce-Scatter": lambda: comm.reduce_scatter(out, full, what="b"),
        "unit: gather + release": lambda: unit.release(unit.gather()),
        "unit: start_reduce + finish_reduce": lambda: unit.finish_reduce(unit.start_reduce(grads)),
    }
    times: dict[str, dict[str, list[float]]] = {}
    for k in range(rounds + 1):  # round 0 warms up (pool, pages of the shared file)
        for transport in ("gloo", "shm") if k % 2 == 0 else ("shm", "gloo"):
            comm.shared = arena if transport == "shm" else None
            for name, op in ops.items():
                dist.barrier()
                cpu, thread, wall = time.process_time(), time.thread_time(), time.perf_counter()
                for _ in range(calls):
                    op()
                cpu, thread = time.process_time() - cpu, time.thread_time() - thread
                wall = time.perf_counter() - wall
                if k:
                    cell = times.setdefault(f"{name} [{transport}]", {c: [] for c in CLOCKS})
                    for clock, seconds in zip(CLOCKS, (cpu, thread, wall)):
                        cell[clock].append(seconds / calls)
        comm.tags.check()
    comm.shared = arena
    _check_equal(comm, unit, grads, arena)
    return times


def _check_equal(comm: Any, unit: Any, grads: list[torch.Tensor], arena: Any) -> None:
    """Both transports give bitwise the same gathered parameters and reduced gradients."""
    results = []
    for shared in (None, arena):
        comm.shared = shared
        fulls = unit.gather()
        gathered = [f.clone() for f in fulls]
        unit.release(fulls)
        reduced = [g.clone() for g in unit.finish_reduce(unit.start_reduce(grads))]
        results.append((gathered, reduced))
    comm.tags.check()
    for a, b in zip(*(sum(r, []) for r in results)):
        assert torch.equal(a, b), "the shared-memory transport gave different values"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="20m")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    ranks: list[Any] = run_ranks(_rank, 2, args.size, args.calls, args.rounds)
    print(
        f"2 ranks, {args.size} block, median over {args.rounds} rounds of {args.calls} calls, ms per call, "
        "rank 0 / rank 1"
    )
    print("| operation [transport] | process CPU | main-thread CPU | wall |\n| --- | --- | --- | --- |")
    medians: dict[str, list[float]] = {}
    for name in ranks[0]:
        cells = []
        for clock in CLOCKS:
            values = [statistics.median(r[name][clock]) * 1e3 for r in ranks]
            cells.append(" / ".join(f"{v:.2f}" for v in values))
            if clock == "cpu":
                medians[name] = values
        print(f"| {name} | {' | '.join(cells)} |")
    gather = [g - s for g, s in zip(medians["unit: gather + release [gloo]"], medians["unit: gather + release [shm]"])]
    red = "unit: start_reduce + finish_reduce"
    reduce = [g - s for g, s in zip(medians[f"{red} [gloo]"], medians[f"{red} [shm]"])]
    # Per step: every unit (the blocks and the root) reduced once, gathered in forward and again in
    # backward except the root and the last block, kept from forward into backward (README).
    units = make_config(args.size, 128).n_layer + 1
    gathers, reductions = 2 * units - 2, units
    step = [gathers * g + reductions * r for g, r in zip(gather, reduce)]
    print(
        f"process CPU saved per gather {gather[0]:.2f} / {gather[1]:.2f} ms, per reduction {reduce[0]:.2f} / "
        f"{reduce[1]:.2f} ms; per {args.size} step ({gathers} gathers + {reductions} reductions): "
        f"{step[0]:.1f} / {step[1]:.1f} ms"
    )


if __name__ == "__main__":
    main()
