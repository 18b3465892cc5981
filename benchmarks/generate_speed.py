"""Greedy HF `generate()` time under ZeRO-3 (default path and `gathered_for_inference()`) next
to DDP, in one run.

    python benchmarks/generate_speed.py [--tokens 96] [--rounds 5] [--devices 2]   # ~1 min on 2 cores

A GPT-2-shaped `transformers.GPT2LMHeadModel` (4 layers, width 128, vocab 512; ~1 M parameters)
generates `--tokens` tokens greedily from an 8-token prompt on every rank (gloo, one thread per
rank). Each round times, in an order that rotates between rounds so that a busy machine slows
every variant alike:

- ddp:      `DistributedDataParallel(model).module.generate(...)`, whole weights on every rank;
- zero3:    `generate()` on the sharded model, every unit gathered again for every token;
- zero3_held: the same inside `ShardedModel.gathered_for_inference()` (entering and leaving it,
            one All-Gather per unit, inside the timed region).

A time is the slowest rank's. Printed: each round's times and ratios to DDP's, then the medians.
Every variant's tokens are checked against DDP's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks.launch import run_ranks  # noqa: E402
from lightning_zero3.engine import ShardedModel  # noqa: E402

VARIANTS = ("ddp", "zero3", "zero3_held")


def gpt2(vocab: int = 512) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=256, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=vocab - 1, eos_token_id=vocab - 1, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def measure(rank: int, world_size: int, tokens: int, rounds: int) -> dict:
    torch.manual_seed(0)
    plain = gpt2()
    torch.manual_seed(0)
    sharded_module = gpt2()
    sharded = ShardedModel(sharded_module)
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    prompt = torch.arange(1, 9).unsqueeze(0)  # (1, 8)
    options = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False}

    def run(variant: str) -> list[int]:
        with torch.no_grad():
            if variant == "ddp":
                return ddp.module.generate(input_ids=prompt, **options)[0].tolist()
            if variant == "zero3":
                return sharded_module.generate(input_ids=prompt, **options)[0].tolist()
            with sharded.gathered_for_inference():
                return sharded_module.generate(input_ids=prompt, **options)[0].tolist()

    for variant in VARIANTS:  # warm-up
        run(variant)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    same = True
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        outputs = {}
        for variant in order:
            dist.barrier()
            start = time.perf_counter()
            outputs[variant] = run(variant)
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            times[variant].append(float(elapsed))
        same = same and outputs["zero3"] == outputs["ddp"] == outputs["zero3_held"]
    return {"times": times, "same_tokens": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average before: {' '.join(f.read().split()[:3])}")
    result = run_ranks(measure, args.devices, args.tokens, args.rounds)[0]
    times = result["times"]
    print(f"greedy generate, {args.tokens} tokens, {args.devices} gloo ranks, seconds (slowest rank):")
    print("round  " + "  ".join(f"{v:>10}" for v in VARIANTS) + "   zero3/ddp  held/ddp")
    for r in range(args.rounds):
        row = [times[v][r] for v in VARIANTS]
        print(f"{r:5d}  " + "  ".join(f"{t:10.3f}" for t in row) + f"   {row[1] / row[0]:9.2f}  {row[2] / row[0]:8.2f}")
    median = {v: statistics.median(times[v]) for v in VARIANTS}
    print(
        "median " + "  ".join(f"{median[v]:10.3f}" for v in VARIANTS)
        + f"   {median['zero3'] / median['ddp']:9.2f}  {median['zero3_held'] / median['ddp']:8.2f}"
    )  # fmt: skip
    print(f"tokens equal across variants: {result['same_tokens']}")
    with open("/proc/loadavg") as f:
        print(f"load average after: {' '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
