"""Helpers for the tests adapted from Lightning's own (tests/test_lightning_*.py, one per file of
Lightning's tests_pytorch): the strategy is a parameter, "ddp" or "zero3", run on 2 gloo CPU ranks
started by `run_ranks` (Lightning's own tests use ddp_spawn there). Where zero3 differs by design
(its default checkpoint is a directory, read with `lightning_zero3.load_checkpoint` /
`lightning_zero3.load_from_checkpoint`), the helpers below pick the call for what is on disk, and
the tests assert which kind each strategy wrote."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_zero3
from tests.lit import become_lightning_rank
from tests.ranks import run_ranks

STRATEGIES = ("ddp", "zero3")
WORLD_SIZE = 2


def lightning_trainer(strategy: str, root: str | Path, **kwargs: Any) -> pl.Trainer:
    """A 2-rank CPU Trainer, quiet, as Lightning's tests build theirs (no logger unless given)."""
    options: dict[str, Any] = dict(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD_SIZE,
        default_root_dir=str(root),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def _as_lightning_rank(rank: int, world_size: int, fn: Callable[..., Any], args: tuple) -> Any:
    become_lightning_rank(rank, world_size)
    return fn(rank, *args)


def on_ranks(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """`fn(rank, *args)` on 2 gloo ranks, each a Lightning rank; their results in rank order."""
    return run_ranks(_as_lightning_rank, WORLD_SIZE, fn, args)


def is_checkpoint(path: str | Path, strategy: str) -> bool:
    """What each strategy writes for one checkpoint: DDP a file, zero3 (sharded, its default) a
    directory with meta.json (docs/checkpoints.md)."""
    path = Path(path)
    return path.is_file() if strategy == "ddp" else (path / "meta.json").is_file()


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dict, in this process: `torch.load` for a file, as Lightning's tests read
    one; `lightning_zero3.load_checkpoint` for a sharded directory (whole tensors)."""
    if Path(path).is_dir():
        return lightning_zero3.load_checkpoint(path)
    return torch.load(path, weights_only=True)


def load_module(cls: type[pl.LightningModule], path: str | Path, **kwargs: Any) -> pl.LightningModule:
    """`cls.load_from_checkpoint(path)` for a file; `lightning_zero3.load_from_checkpoint` for a
    sharded directory, which Lightning's own call cannot open (IsADirectoryError)."""
    if Path(path).is_dir():
        return lightning_zero3.load_from_checkpoint(cls, path, **kwargs)
    return cls.load_from_checkpoint(path, **kwargs)
