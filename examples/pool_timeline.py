"""The engine's buffer pool across a `fit`, as a user meets it (issue 36): 8 x Linear(2560, 2560)
in fp32 (200 MiB), 2 CPU ranks, a callback calling `gathered_for_inference()` and
`full_state_dict()` at each validation. Rank 0 records, at every buffer the pool hands out or
takes back, its pooled bytes (free buffers) and live bytes (pooled + handed out), and at each
epoch's end anonymous RSS after `gc.collect()`; `--plot` draws runs side by side.

    python examples/pool_timeline.py --json after.json                      # this checkout
    PYTHONPATH=<older checkout> python examples/pool_timeline.py --json before.json
    python examples/pool_timeline.py --plot before.json after.json --out docs/figures/pool-timeline.png
    python examples/pool_timeline.py --no-state-dict --json repro.json      # gathered_for_inference() only

The spy wraps the pool's `take` and `give` and reads the storages' bytes, so it runs on engines
before and after size classes alike. Needs matplotlib for `--plot` (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: benchmarks

from benchmarks.measure import status_bytes  # noqa: E402

WIDTH, LAYERS = 2560, 8


def record(pool: Any, events: list[dict[str, Any]], phase: list[str]) -> Callable[[], None]:
    """Wrap `pool.take`/`pool.give` on this instance: an event with the bytes after each call;
    returns the function that adds one (for what the pool lets go without a call: a block's end)."""
    take, give = pool.take, pool.give
    taken: dict[int, int] = {}  # data_ptr -> bytes handed out

    def pooled() -> int:
        return sum(b.untyped_storage().nbytes() for free in pool._free.values() for b, *_ in free)

    def note() -> None:
        held = pooled()
        events.append({"pooled": held, "live": held + sum(taken.values()), "phase": phase[0]})

    def spied_take(*args: Any) -> torch.Tensor:
        buffer = take(*args)
        taken[buffer.untyped_storage().data_ptr()] = buffer.untyped_storage().nbytes()
        note()
        return buffer

    def spied_give(role: str, buffer: torch.Tensor) -> None:
        taken.pop(buffer.untyped_storage().data_ptr(), None)
        give(role, buffer)
        note()

    pool.take, pool.give = spied_take, spied_give
    return note


def fit(path: str, epochs: int, *, state_dict: bool) -> None:
    import lightning as L

    from lightning_zero3 import ZeRO3Strategy

    class Stack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))  # one unit each

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self(batch).pow(2).mean()

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    events: list[dict[str, Any]] = []
    phase = ["train"]
    rss: list[int] = []
    note: list[Callable[[], None]] = []

    class Timeline(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            note.append(record(trainer.strategy.sharded_model()._pool, events, phase))

        def on_train_batch_start(self, *args: Any) -> None:
            phase[0] = "train"

        def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            phase[0] = "gathered_for_inference"
            with trainer.strategy.gathered_for_inference(), torch.no_grad():
                pl_module(torch.randn(2, WIDTH))
            note[0]()  # after the block: what it let go
            phase[0] = "full_state_dict"
            if state_dict:
                trainer.strategy.full_state_dict()
            phase[0] = "after"
            note[0]()
            gc.collect()
            rss.append(status_bytes("RssAnon"))

    batches = torch.utils.data.DataLoader(torch.randn(16, WIDTH), batch_size=2)
    trainer = L.Trainer(
        strategy=ZeRO3Strategy(), accelerator="cpu", devices=2, max_epochs=epochs, limit_train_batches=3,
        limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timeline()],
    )  # fmt: skip
    trainer.fit(Stack(), batches, batches)
    if trainer.global_rank == 0:
        with open(path, "w") as file:
            json.dump({"events": events, "rss_anon_after_each_validation": rss}, file)
        print(f"RssAnon after each validation (rank 0, MiB): {[round(r / 2**20, 1) for r in rss]}")
        after = [e["pooled"] / 2**20 for e in events if e["phase"] == "after"]
        print(f"pooled after each validation (MiB): {[round(a, 1) for a in after]}")


def plot(paths: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4), sharey=True, squeeze=False)
    for ax, path in zip(axes[0], paths):
        with open(path) as file:
            events = json.load(file)["events"]
        x = range(len(events))
        ax.plot(x, [e["live"] / 2**20 for e in events], label="live (pooled + handed out)")
        ax.plot(x, [e["pooled"] / 2**20 for e in events], label="pooled (free)")
        for i, e in enumerate(events):
            if e["phase"] == "gathered_for_inference" and events[i - 1]["phase"] != e["phase"]:
                ax.axvline(i, color="grey", linestyle=":", linewidth=1)
        ax.set_title(os.path.splitext(os.path.basename(path))[0])
        ax.set_xlabel("pool events (take/give), rank 0; dotted: a validation's gathered_for_inference")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MiB")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="pool-timeline.json", help="where rank 0 writes the timeline")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--no-state-dict", action="store_true", help="gathered_for_inference() only (issue 36's repro)")
    parser.add_argument("--plot", nargs="+", help="timelines to draw side by side (no training)")
    parser.add_argument("--out", default="pool-timeline.png")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.out)
    else:
        fit(args.json, args.epochs, state_dict=not args.no_state_dict)


if __name__ == "__main__":
    main()
