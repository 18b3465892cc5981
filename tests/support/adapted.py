"""Helpers for the tests adapted from Lightning's own (tests/lightning/test_lightning_*.py, one per file of
Lightning's tests_pytorch): the strategy is a parameter, "ddp" or "zero3", on 2 CPU ranks. As in
Lightning's own tests (ddp_spawn there), the test process builds the Trainer and calls fit/test,
and the strategy's multiprocessing launcher starts the ranks and hands rank 0's results back
(weights, `callback_metrics`, ModelCheckpoint's best path): `launched(strategy)` is that strategy,
started from the forkserver of tests/support/ranks.py, which has imported torch and Lightning once. A test
that needs each rank's view runs `fn(rank, ...)` on gloo ranks of that harness (`on_ranks`). Where
zero3 differs by design (its default checkpoint is a directory, read with
`lightning_zero3.load_checkpoint` / `lightning_zero3.load_from_checkpoint`), the helpers below pick
the call for what is on disk, and the tests assert which kind each strategy wrote."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override

import lightning_zero3
from tests.support.lit import become_lightning_rank
from tests.support.ranks import _mp_context, run_ranks

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


def launched(strategy: str, **options: Any) -> Strategy:
    """The strategy named (with `options`), started by Lightning's multiprocessing launcher from
    the forkserver of tests/support/ranks.py (which preloads torch, Lightning and these tests, so a launch
    costs well under a second), with a collective timeout so that a hang fails the test."""
    _mp_context()  # the forkserver's preload is set before it starts
    cls = _UnsharedDDP if strategy == "ddp" else lightning_zero3.ZeRO3Strategy
    return cls(start_method="forkserver", timeout=timedelta(seconds=60), **options)


class _UnsharedLauncher(_MultiProcessingLauncher):
    """Lightning's launcher, but each rank copies the module's tensors it unpickled. torch pickles a
    CPU tensor into memory shared by every rank; Lightning copies them for "spawn" only
    (`_disable_module_memory_sharing`), not for "forkserver", which pickles alike: DDP's ranks then
    step the same weights (twice the update, racing)."""

    @override
    def _wrapping_function(self, process_idx: int, trainer: Any, function: Any, args: Any, *rest: Any) -> None:
        args = _disable_module_memory_sharing(args)
        super()._wrapping_function(process_idx, trainer, function, args, *rest)


class _UnsharedDDP(DDPStrategy):
    @override
    def _configure_launcher(self) -> None:
        self._launcher = _UnsharedLauncher(self, start_method=self._start_method)


def hand_back(trainer: pl.Trainer, **values: Any) -> None:
    """Put what a rank saw (numbers, lists of them, or strings) into `trainer.callback_metrics`,
    which the launcher hands back from rank 0 to the test process."""
    trainer.callback_metrics.update({k: v if isinstance(v, str) else torch.tensor(v) for k, v in values.items()})


class HandsBack(pl.Callback):
    """Hands back what every rank saw: at the end of each launched run (the `teardown` hook, after
    the strategy's own: under zero3 the module at rest), each rank reads the trainer's attributes
    named by dotted paths ("lightning_module.step_losses", "callback_metrics.val_loss"); in the test
    process `trainer.callback_metrics[name]` is then a list of the ranks' values, in rank order."""

    def __init__(self, **paths: str) -> None:
        self.paths = paths

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        seen = {name: _attribute(trainer, path) for name, path in self.paths.items()}
        every_rank: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(every_rank, seen)
        trainer.callback_metrics.update({name: [rank[name] for rank in every_rank] for name in seen})


class SavesAfterFit(pl.Callback):
    """`trainer.save_checkpoint(path)` on every rank after `fit`, the strategy torn down (its
    `on_fit_end`), as a user's script saves after `fit` returns."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _attribute(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
    return obj


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
