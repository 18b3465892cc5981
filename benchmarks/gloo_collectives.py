"""Time one unit's All-Gather and Reduce-Scatter on CPU/gloo, both ways the engine can run them:
gloo's own collectives (`all_gather_single`, `reduce_scatter_single`: the path NCCL takes) and the
in-place broadcasts and send/recv the engine uses on gloo (lightning_zero3/engine/comm.py, Note:
gloo), with an in-place All-Reduce of the same buffer for scale. Each figure is the median over
rounds of the mean of `--repeat` back-to-back calls, on rank 0.

    python benchmarks/gloo_collectives.py                 # 2 ranks, a 2.4M-element fp32 unit
    python benchmarks/gloo_collectives.py --ranks 3 --numel 600000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.ranks import run_ranks  # noqa: E402


def _time(rank: int, world_size: int, numel: int, repeat: int, rounds: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from lightning_zero3.engine.comm import Comm

    comm = Comm()
    chunk = -(-numel // world_size)
    shard = torch.randn(chunk)
    gathered = torch.empty(world_size * chunk)
    full = torch.randn(world_size, chunk)
    out = torch.empty(chunk)

    def gather() -> None:
        comm.all_gather(gathered, shard, async_op=False, what="benchmark")

    def reduce() -> None:
        comm.reduce_scatter(out, full, what="benchmark")

    def all_reduce() -> None:
        dist.all_reduce(full)

    cases = {}
    for in_place in (False, True):
        label = "in place (broadcasts, send/recv)" if in_place else "gloo's own"
        cases[f"All-Gather, {label}"] = (in_place, gather)
        cases[f"Reduce-Scatter, {label}"] = (in_place, reduce)
    cases["All-Reduce of the Reduce-Scatter's input (in place)"] = (False, all_reduce)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):  # alternate, so drift on a shared machine hits every case alike
        for name, (in_place, fn) in cases.items():
            comm.gloo_in_place = in_place
            fn()  # warm
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / repeat)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--numel", type=int, default=2_400_000, help="elements of the unit (fp32)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result = run_ranks(_time, args.ranks, args.numel, args.repeat, args.rounds, timeout_s=600)[0]
    print(f"{args.ranks} ranks, unit of {args.numel:,} fp32 elements ({args.numel * 4 / 1e6:.1f} MB), rank 0:")
    print("| operation | ms per call |\n| --- | --- |")
    for name, seconds in result.items():
        print(f"| {name} | {seconds * 1e3:.2f} |")


if __name__ == "__main__":
    main()
