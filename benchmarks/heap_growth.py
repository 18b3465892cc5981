"""Peak RSS per rank over a number of steps of the bare engine, to see whether the process's
memory stays flat (it should: nothing is kept between steps but shards and optimizer state).

    python benchmarks/heap_growth.py                       # 40 steps, no heap trimming (the default)
    python benchmarks/heap_growth.py --trim --steps 40      # with the slack-based malloc_trim (opt-in)
    python benchmarks/heap_growth.py --ddp                 # the same loop under PyTorch DDP
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.ranks import run_ranks  # noqa: E402


def _peak_rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) // 1024


def _train(rank: int, world_size: int, steps: int, trim: bool, ddp: bool) -> tuple[float, list[int]]:
    from train_gpt import GPT, GPTConfig

    from lightning_zero3.engine import ShardedModel

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=128, n_layer=6, n_head=8, n_embd=256))  # ~5M parameters
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        ShardedModel(model, prefetch=1, trim_host_memory=trim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    times, peaks = [], []
    for _ in range(steps):
        x = torch.randint(0, 96, (8, 128), generator=generator)  # (B, T) tokens
        start = time.perf_counter()
        F.cross_entropy(model(x).view(-1, 96), x.view(-1)).backward()  # next-token shift irrelevant here
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        peaks.append(_peak_rss_mib())
    return sorted(times[5:])[len(times[5:]) // 2], peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--trim", action="store_true", help="ShardedModel(trim_host_memory=True)")
    parser.add_argument("--ddp", action="store_true", help="PyTorch DDP instead of the ZeRO-3 engine")
    args = parser.parse_args()
    marks = sorted({0, 9, 19, 29, 39, 79, 119, args.steps - 1} & set(range(args.steps)))
    for rank, (median, peaks) in enumerate(run_ranks(_train, 2, args.steps, args.trim, args.ddp, timeout_s=900)):
        shown = ", ".join(f"{i + 1}: {peaks[i]}" for i in marks)
        print(f"rank {rank}: median step {median:.3f} s; peak RSS (MiB) after step {shown}")


if __name__ == "__main__":
    main()
