"""Peak memory of loading a sharded checkpoint into one process (docs/checkpoints.md, "The best
model in one process"): VmHWM growth of `load_checkpoint` and of `load_from_checkpoint`, each in a
fresh process, for 12 Linear(2048, 2048) layers (192 MiB of fp32 weights) saved at 2 ranks.

    PYTHONPATH=. python benchmarks/plain_load_memory.py DIR save
    PYTHONPATH=. python benchmarks/plain_load_memory.py DIR dict
    PYTHONPATH=. python benchmarks/plain_load_memory.py DIR module

and of consolidating it into one file (docs/checkpoints.md, "How the streaming works"): through
the command, which sets glibc's mmap threshold in its own process, and through the library call,
which leaves the allocator alone:

    PYTHONPATH=. python benchmarks/plain_load_memory.py DIR consolidate-command
    PYTHONPATH=. python benchmarks/plain_load_memory.py DIR consolidate-call
"""

from __future__ import annotations

import runpy
import sys

import lightning.pytorch as pl
import torch

import lightning_zero3

LAYERS, WIDTH = 12, 2048


def peak_rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))


class Stack(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def _save(rank: int, world_size: int, path: str) -> None:
    from lightning_zero3 import ShardedModel
    from lightning_zero3.checkpoint import save_sharded

    model = Stack()
    sharded = ShardedModel(model)
    checkpoint = {"state_dict": model.state_dict(), "pytorch-lightning_version": pl.__version__}  # shards
    save_sharded(path, sharded, checkpoint)


def main(directory: str, what: str) -> None:
    path = f"{directory}/stack.ckpt"
    if what == "save":
        from tests.ranks import run_ranks

        run_ranks(_save, 2, path, timeout_s=300)
        return
    weights = LAYERS * WIDTH * WIDTH * 4
    before = peak_rss()
    if what == "dict":
        lightning_zero3.load_checkpoint(path)
    elif what == "module":
        lightning_zero3.load_from_checkpoint(Stack, path)
    elif what == "consolidate-command":  # as `python -m lightning_zero3 consolidate` runs it
        sys.argv = ["lightning_zero3", "consolidate", path, f"{directory}/consolidated.ckpt"]
        try:
            runpy.run_module("lightning_zero3", run_name="__main__")
        except SystemExit as exit:
            assert not exit.code, exit.code
    elif what == "consolidate-call":
        lightning_zero3.consolidate_checkpoint(path, f"{directory}/consolidated.ckpt")
    else:
        raise SystemExit(f"unknown mode {what!r}: save, dict, module, consolidate-command or consolidate-call")
    growth = peak_rss() - before
    print(f"{what}: {weights / 2**20:.0f} MiB of weights, peak RSS growth {growth / 2**20:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
