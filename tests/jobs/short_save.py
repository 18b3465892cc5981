"""A short 2-rank job that fits and then saves a sharded checkpoint, launched as users launch one
(`python short_save.py ...`: Lightning's launcher re-runs this script for rank 1). Each rank
writes OUT/rank{r}.done as its last act, and OUT/threads-{pid}.txt, the names of the threads
still alive when Python is about to finalize (after every exit handler): gloo's workers
("pt_gloo_runloop") must be gone by then (lightning_zero3/engine/groups.py, Note: leaving at exit).
benchmarks/exit_stress.py runs many of these at once; tests/reliability/test_clean_exit.py one of each."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from datetime import timedelta

_OUT: list[str] = []  # the --out directory, once parsed


def _threads_at_exit() -> None:
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    for out in _OUT:
        with open(os.path.join(out, f"threads-{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(names) + "\n")


if os.path.isdir("/proc/self/task"):
    atexit.register(_threads_at_exit)  # before importing the package: runs after its exit handlers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_zero3 import ZeRO3FabricStrategy, ZeRO3Strategy  # noqa: E402
from tests.support import models  # noqa: E402
from tests.support.lit import LitMLP, loader, trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--api", choices=("trainer", "fabric"), default="trainer")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--keep-gathered", action="store_true", help="reshard_after_forward=False")
    args = parser.parse_args()
    _OUT.append(args.out)
    options = dict(
        timeout=timedelta(seconds=120), async_save=args.async_save, reshard_after_forward=not args.keep_gathered
    )
    torch.manual_seed(0)
    path = os.path.join(args.out, "ckpt")
    if args.api == "trainer":
        model = LitMLP()
        t = trainer(ZeRO3Strategy(**options), 2, max_steps=2)
        t.fit(model, loader(2))
        t.save_checkpoint(path)
        rank = t.global_rank
    else:
        import lightning as L

        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ZeRO3FabricStrategy(**options))
        fabric.launch()
        net = models.MLP()
        module, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
        for step in range(2):
            x, y = models.mlp_batch(step)
            fabric.backward(F.mse_loss(module(x), y))
            optimizer.step()
            optimizer.zero_grad()
        fabric.save(path, {"model": module, "optimizer": optimizer})
        rank = fabric.global_rank
    with open(os.path.join(args.out, f"rank{rank}.done"), "w") as f:
        f.write("done\n")


if __name__ == "__main__":
    main()
