"""Eager step time and peak RSS of the engine with its two ways of emptying and refilling the
storage of full parameters that autograd keeps from forward to backward (unit.py, Note:
full-parameter blocks):

- swap:   the block's memory moves out to the pool and back (`UntypedStorage._swap_data_ptr_`);
- resize: the storage is freed and allocated again (`untyped_storage().resize_()`, FSDP2's way).

    python benchmarks/storage_paths.py [--size 5m] [--rounds 4] [--steps 8]   # ~2 min on 2 cores

Each round runs both paths, each in a fresh pair of gloo ranks (one thread each), in an order
that alternates between rounds; a run trains `--steps` AdamW steps of the GPT of
benchmarks/model.py and reports, as medians over the steps after 3 warm-up steps: the wall
time of a step (the slowest rank's), its CPU time and minor page faults (both ranks summed:
less sensitive to other processes than wall time), and the peak RSS growth over those steps.
Printed: each round, then the medians of the rounds.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks.launch import run_ranks  # noqa: E402
from benchmarks.measure import peak_rss_bytes, reset_peak_rss  # noqa: E402
from benchmarks.model import build_model, lm_loss, make_batches, make_config, window_length  # noqa: E402

PATHS = ("swap", "resize")
KEYS = ("step", "cpu", "faults", "peak_growth_mib")
WARMUP = 3


def minor_faults() -> int:
    """Page faults served without I/O so far in this process (fresh memory touched for the first time)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def train(rank: int, world_size: int, path: str, size: str, steps: int, batch: int) -> dict:
    from lightning_zero3.engine import ShardedModel, unit

    unit._SWAP_STORAGE = path == "swap" and unit._SWAP_STORAGE
    windows, vocab = make_batches(
        block_size=window_length(size), batch_size=batch, world_size=world_size, steps=steps, seed=0
    )  # (steps, N, B, T + 1)
    model = build_model(make_config(size, vocab), seed=0, device=torch.device("cpu"))
    ShardedModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, cpu_times, fault_counts, losses = [], [], [], []
    peak_before = 0
    for step in range(steps):
        if step == WARMUP:
            reset_peak_rss()
            peak_before = peak_rss_bytes()
        x, y = windows[step, rank, :, :-1].contiguous(), windows[step, rank, :, 1:].contiguous()  # (B, T) each
        dist.barrier()
        start, cpu, faults = time.perf_counter(), time.process_time(), minor_faults()
        loss = lm_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # (wall seconds, CPU seconds, page faults); wall: the slowest rank's, the others summed
        spent = torch.tensor(
            [time.perf_counter() - start, time.process_time() - cpu, minor_faults() - faults], dtype=torch.float64
        )
        wall = spent[:1].clone()
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(spent)
        times.append(float(wall))
        cpu_times.append(float(spent[1]))
        fault_counts.append(float(spent[2]))
        losses.append(float(loss.detach()))
    return {
        "step": statistics.median(times[WARMUP:]),
        "cpu": statistics.median(cpu_times[WARMUP:]),
        "faults": statistics.median(fault_counts[WARMUP:]),
        "peak_growth_mib": (peak_rss_bytes() - peak_before) / 2**20,
        "losses": losses,
        "swap": unit._SWAP_STORAGE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="5m")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average before: {' '.join(f.read().split()[:3])}")
    print(f"torch {torch.__version__}, size {args.size}, 2 gloo ranks, median of steps {WARMUP}..{args.steps - 1}")
    rows: dict[str, dict[str, list[float]]] = {p: {k: [] for k in KEYS} for p in PATHS}
    losses: dict[str, list[float]] = {}

    def show(label: str, values: dict[str, dict[str, float]]) -> None:
        cells = [
            f"{p} {values[p]['step']:.3f} s wall, {values[p]['cpu']:.3f} s CPU, {values[p]['faults']:.0f} faults, "
            f"+{values[p]['peak_growth_mib']:.0f} MiB"
            for p in PATHS
        ]
        ratios = ", ".join(f"{k} {values['resize'][k] / max(values['swap'][k], 1e-9):.3f}" for k in ("step", "cpu"))
        print(f"{label}: " + " | ".join(cells) + f" | resize/swap: {ratios}")

    for r in range(args.rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            result = run_ranks(train, 2, path, args.size, args.steps, args.batch, timeout_s=900)[0]
            assert result["swap"] == (path == "swap"), "this torch has no _swap_data_ptr_"
            for key in KEYS:
                rows[path][key].append(result[key])
            losses[path] = result["losses"]
        show(f"round {r}", {p: {k: rows[p][k][-1] for k in KEYS} for p in PATHS})
    show("median ", {p: {k: statistics.median(rows[p][k]) for k in KEYS} for p in PATHS})
    print(f"losses equal: {losses['swap'] == losses['resize']}")
    with open("/proc/loadavg") as f:
        print(f"load average after: {' '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
