"""Memory a training step adds per rank, all layers trainable vs most of them frozen.

    python benchmarks/frozen_memory.py [--steps 3] [--devices 2]      # ~30-60 s on 2 cores

A stack of 24 nn.Linear(2048, 2048) (16 MiB each, 384 MiB in fp32) is sharded over the ranks
(`ShardedModel`, one unit per layer) and trained with SGD. For each case every rank prints its
resident memory when setup is done (model sharded, optimizer built) and how far its peak (VmHWM,
reset through /proc/self/clear_refs) rose above that during the steps:

- trainable:  every layer trains; a step adds the gradient shards (384 MiB / N) plus the few
              units whose full parameters and gradients are alive at once;
- frozen:     layers 1..22 frozen (`requires_grad_(False)`), layers 0 and 23 train; they still
              run backward (their input needs a gradient), so they are re-gathered for it, but
              only ~2 units are whole at a time: a step adds 2 trainable layers' gradient shards
              plus a few units, not the frozen layers' full weights.

Linux only (reads /proc/self/status). Run it with `PYTHONPATH` pointing at another checkout to
compare versions of the engine.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests.ranks

from benchmarks.measure import reset_peak_rss, status_bytes  # noqa: E402
from lightning_zero3.engine import ShardedModel  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

MB = 2**20
WIDTH, DEPTH = 2048, 24


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def measure(rank: int, world_size: int, frozen: bool, steps: int) -> dict:
    with torch.device("meta"):
        model = Stack()
    if frozen:
        for layer in model.layers[1:-1]:
            layer.requires_grad_(False)
    sharded = ShardedModel(model, device="cpu")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    setup = reset_peak_rss()
    for _ in range(steps):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradient shards: they are step memory
    return {
        "setup_mib": setup / MB,
        "step_growth_mib": (status_bytes("VmHWM") - setup) / MB,
        "peak_units": sharded.unit_stats.peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    layer_mib = WIDTH * (WIDTH + 1) * 4 / MB
    print(f"{DEPTH} x Linear({WIDTH}, {WIDTH}): {DEPTH * layer_mib:.0f} MiB, {layer_mib:.0f} MiB per layer; "
          f"{args.devices} ranks, {args.steps} steps")  # fmt: skip
    print(f"{'case':<10} {'rank':>4} {'after setup MiB':>16} {'step growth MiB':>16} {'units whole (peak)':>19}")
    for case in ("trainable", "frozen"):
        results = run_ranks(measure, args.devices, case == "frozen", args.steps, timeout_s=600)
        for rank, r in enumerate(results):
            print(f"{case:<10} {rank:>4} {r['setup_mib']:>16.0f} {r['step_growth_mib']:>16.0f} {r['peak_units']:>19}")


if __name__ == "__main__":
    main()
