"""The Trainer's checkpoint hooks under `ZeRO3Strategy`, on top of the run (core.py) and
lightning_zero3/checkpoint/; `ZeRO3Strategy`'s methods that Lightning calls for checkpoints
delegate here, as Fabric's `fabric.save`/`fabric.load` delegate to fabric_checkpoint.py.

- "sharded": every rank writes its own shards into a directory, nothing is gathered
  (docs/checkpoints.md).
- "full": gathered unit by unit to rank 0, one ordinary Lightning file.
Loading takes either, at any world size; ranks agree that a checkpoint is readable and fits the
model before any collective that loads it (checkpoint/errors.py, Note: no hang on a bad checkpoint).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from torch.optim import Optimizer

from lightning_zero3.checkpoint import CheckpointError
from lightning_zero3.checkpoint import remove_checkpoint as remove_checkpoint_path
from lightning_zero3.checkpoint.errors import run_and_agree
from lightning_zero3.checkpoint.format import ShardedOptimizerStates, ShardedStateDict
from lightning_zero3.checkpoint.load import load_sharded_model, load_sharded_optimizers
from lightning_zero3.checkpoint.remote import as_path
from lightning_zero3.core import ShardedRun
from lightning_zero3.engine.state import load_full_optimizer_state
from lightning_zero3.options import checkpoint_io_files

log = logging.getLogger(__name__)


def load_checkpoint(
    run: ShardedRun,
    filepath: str | os.PathLike,
    checkpoint_io: CheckpointIO,
    *,
    weights_only: bool | None,
    strict: bool,
) -> dict[str, Any]:
    """A sharded directory (its Lightning dict, tensors still on disk) or a full Lightning file."""
    path = as_path(filepath)
    run.wait_for_save()  # it may be writing this very path
    context = f"Cannot load the checkpoint {path}"
    trusted = run.trusted(weights_only)
    if path.is_dir():
        ckpt = run.open_sharded(path, strict=strict, trusted=trusted, context=context)
        return run_and_agree(run.engine.world_comm, ckpt.lightning_dict, context=context)

    read = checkpoint_io_files(checkpoint_io, weights_only=weights_only)[1]
    return run.read_full(path, read, trusted=trusted, strict=strict, context=context, key="state_dict")


def save_checkpoint(
    run: ShardedRun, checkpoint: dict[str, Any], path: str | os.PathLike, checkpoint_io: CheckpointIO
) -> None:
    run.save(as_path(path), checkpoint, checkpoint_io_files(checkpoint_io)[0], background=run.options().async_save)


def load_model_state_dict(run: ShardedRun, checkpoint: Mapping[str, Any], strict: bool) -> None:
    state_dict = checkpoint["state_dict"]
    if isinstance(state_dict, ShardedStateDict):
        load_sharded_model(state_dict.checkpoint, run.engine)
    else:
        run.engine.load_full_state_dict(dict(state_dict), strict=strict)


def load_optimizer_state_dict(run: ShardedRun, checkpoint: Mapping[str, Any], optimizers: list[Optimizer]) -> None:
    states = checkpoint["optimizer_states"]
    if isinstance(states, ShardedOptimizerStates):
        load_sharded_optimizers(states.checkpoint, run.engine, optimizers)
        return
    if len(states) != len(optimizers):
        raise CheckpointError(
            f"The checkpoint has state for {len(states)} optimizers but `configure_optimizers` returned "
            f"{len(optimizers)}; resume with the same optimizers."
        )
    for optimizer, state in zip(optimizers, states):
        load_full_optimizer_state(run.engine, optimizer, state)


def remove_checkpoint(filepath: str | Path, checkpoint_io: CheckpointIO, run: ShardedRun | None = None) -> None:
    """Rank 0 only, as Lightning calls it; no collective. While a save writes in the background,
    once it has succeeded (Note: background saves in checkpoint/background.py)."""
    if run is not None and run.saving is not None:
        run.saving.then(lambda: remove_checkpoint(filepath, checkpoint_io))
        return
    if not as_path(filepath).is_dir() and type(checkpoint_io) is not TorchCheckpointIO:
        checkpoint_io.remove_checkpoint(filepath)  # a full file in the plugin's format
        return
    try:
        remove_checkpoint_path(filepath)  # a sharded directory, a file, or a link to either
    except CheckpointError as err:
        # A warning, not an exception, keeps the ranks in step; what is not a checkpoint stays
        # (Note: what a save may replace).
        log.warning(str(err))
