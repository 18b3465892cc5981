"""Where a training step's CPU time goes, DDP against the engine: CPU seconds per step in
forward, backward and the optimizer step (process time: the main thread and gloo's threads),
the main thread's alone, and, for the engine, the main thread's time inside each of its unit
operations (gather, start_gather, release, start_reduce, finish_reduce). 2 gloo ranks, the GPT
of `benchmarks/compare.py`, AdamW, one torch thread per rank, a plain loop (no Lightning).

    python benchmarks/step_phases.py [--size 20m] [--steps 6] [--backends ddp,engine]

Medians over the steps after 2 warm-up steps, per rank. CPU time is far less sensitive than
wall time to other processes on the machine, which is why this reports it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_zero3` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.backends import make_optimizer
from benchmarks.launch import run_ranks
from benchmarks.model import build_model, lm_loss, make_batches, make_config, window_length

WARMUP = 2
UNIT_OPS = ("start_gather", "gather", "release", "start_reduce", "finish_reduce")


def _time_unit_ops(spent: dict[str, float]) -> list[tuple[str, Any]]:
    """Wrap the engine's unit operations so that each adds its main-thread CPU time to `spent`;
    returns what to restore."""
    from lightning_zero3.engine.unit import Unit

    saved = [(name, getattr(Unit, name)) for name in UNIT_OPS]
    for name, original in saved:

        def timed(self: Any, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.thread_time() - start

        setattr(Unit, name, functools.wraps(original)(timed))
    return saved


def _rank(rank: int, world_size: int, backend: str, size: str, steps: int) -> list[dict[str, float]]:
    windows, vocab = make_batches(
        block_size=window_length(size), batch_size=8, world_size=world_size, steps=WARMUP + steps, seed=0
    )
    model = build_model(make_config(size, vocab), seed=0, device=torch.device("cpu"))
    spent: dict[str, float] = {}
    saved: list[tuple[str, Any]] = []
    if backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from lightning_zero3.engine import ShardedModel

        saved = _time_unit_ops(spent)
        ShardedModel(model, prefetch=1)
    optimizer = make_optimizer(model.parameters(), 3e-4)
    rows = []
    try:
        for step in range(WARMUP + steps):
            x, y = windows[step, rank, :, :-1].contiguous(), windows[step, rank, :, 1:].contiguous()
            spent.clear()
            t0, m0 = time.process_time(), time.thread_time()
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model, x, y)
            t1 = time.process_time()
            loss.backward()
            t2 = time.process_time()
            optimizer.step()
            t3, m3 = time.process_time(), time.thread_time()
            row = {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0}
            row["main thread"] = m3 - m0
            rows.append({**row, **{f"  unit.{k}": v for k, v in spent.items()}})
    finally:
        if saved:
            from lightning_zero3.engine.unit import Unit

            for name, original in saved:
                setattr(Unit, name, original)
    return rows[WARMUP:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="20m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--backends", default="ddp,engine")
    args = p.parse_args(argv)
    for backend in args.backends.split(","):
        ranks = run_ranks(_rank, 2, backend, args.size, args.steps)
        print(f"{backend} ({args.size}, 2 ranks): CPU ms per step, median of {args.steps} steps, rank 0 / rank 1")
        for key in ranks[0][0]:
            values = [statistics.median(row[key] for row in rows) * 1e3 for rows in ranks]
            print(f"  {key:<20} {' / '.join(f'{v:7.1f}' for v in values)}")


if __name__ == "__main__":
    main()
