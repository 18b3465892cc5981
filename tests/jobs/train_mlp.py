"""A training job launched the way users launch multi-node runs (torchrun, SLURM): each
process writes what it saw to OUT/rank{global_rank}.pt for the test to check."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_zero3 import ZeRO3Strategy  # noqa: E402
from tests.support.lit import LitMLP, loader, trainer  # noqa: E402


class _DieAt(pl.Callback):
    """Kill this process at a given step, as a crashed node would."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os._exit(17)


class _SaveAt(pl.Callback):
    """Save a checkpoint inside `fit`, after a given step."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-step", type=int, default=1)
    parser.add_argument("--save-step", type=int, default=-1, help="save a checkpoint inside fit after this step")
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    world_size = args.num_nodes * args.devices
    torch.manual_seed(0)
    model = LitMLP()
    strategy = ZeRO3Strategy(timeout=timedelta(seconds=args.timeout), async_save=args.async_save)
    callbacks = [_DieAt(args.die_rank, args.die_step), _SaveAt(args.save_step, os.path.join(args.out, "inside-fit"))]
    t = trainer(strategy, args.devices, num_nodes=args.num_nodes, max_epochs=1, callbacks=callbacks)
    t.fit(model, loader(world_size))
    torch.save(
        {
            "global_rank": t.global_rank,
            "world_size": t.world_size,
            "environment": type(strategy.cluster_environment).__name__,
            "losses": model.step_losses,
            "state": strategy.full_state_dict(rank0_only=False),
        },
        os.path.join(args.out, f"rank{t.global_rank}.pt"),
    )


if __name__ == "__main__":
    main()
