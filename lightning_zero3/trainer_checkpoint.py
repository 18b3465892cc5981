"""The Trainer's checkpoint hooks under `ZeRO3Strategy`, on top of lightning_zero3/checkpoint/.

`ZeRO3Strategy`'s methods that Lightning calls for checkpoints (`save_checkpoint`,
`load_checkpoint`, `lightning_module_state_dict`, ...) delegate here, as `ZeRO3FabricStrategy`'s
`fabric.save`/`fabric.load` delegate to fabric_checkpoint.py.

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
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero3.checkpoint import CheckpointError, load_full, save_full, save_sharded, sharded_optimizer_state
from lightning_zero3.checkpoint import remove_checkpoint as remove_checkpoint_path
from lightning_zero3.checkpoint.errors import require_exists, run_and_agree
from lightning_zero3.checkpoint.format import ShardedOptimizerStates, ShardedStateDict
from lightning_zero3.checkpoint.load import load_sharded_model, load_sharded_optimizers, open_checked
from lightning_zero3.engine.state import full_optimizer_state, load_full_optimizer_state

if TYPE_CHECKING:
    from lightning_zero3.strategy import ZeRO3Strategy

log = logging.getLogger(__name__)


def lightning_module_state_dict(strategy: ZeRO3Strategy) -> dict[str, Any]:
    if strategy.state_dict_type == "sharded" or strategy.whole:
        module = strategy.lightning_module
        assert module is not None
        return module.state_dict()  # this rank's shards (whole after teardown)
    return strategy.sharded_model.full_state_dict(to_rank=0)


def optimizer_state(strategy: ZeRO3Strategy, optimizer: Optimizer) -> dict[str, Tensor]:
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    if strategy.state_dict_type == "sharded":
        return sharded_optimizer_state(strategy.sharded_model, optimizer)
    return full_optimizer_state(strategy.sharded_model, optimizer, to_rank=0)


def save_checkpoint(
    strategy: ZeRO3Strategy, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None
) -> None:
    if storage_options is not None:
        raise TypeError(
            f"`{type(strategy).__name__}.save_checkpoint(..., storage_options=...)` is not supported: the "
            f"checkpoint is written by {type(strategy).__name__}, not by a CheckpointIO plugin."
        )
    path = Path(strategy.broadcast(os.fspath(filepath)))
    if strategy.state_dict_type == "sharded":
        save_sharded(path, strategy.sharded_model, checkpoint, whole=strategy.whole)
        return
    write = None if type(strategy.checkpoint_io) is TorchCheckpointIO else strategy.checkpoint_io.save_checkpoint
    save_full(checkpoint, path, strategy.sharded_model.world_comm, write=write)


def load_checkpoint(strategy: ZeRO3Strategy, checkpoint_path: str | Path, weights_only: bool | None) -> dict[str, Any]:
    path = Path(strategy.broadcast(os.fspath(checkpoint_path)))
    model = strategy.sharded_model
    strict = strategy.lightning_module.strict_loading if strategy.lightning_module is not None else True
    context = f"Cannot load the checkpoint {path}"
    require_exists(model.world_comm, path, context=context)
    trusted = strategy.trust_checkpoint or weights_only is False
    if path.is_dir():
        ckpt = open_checked(path, model, strict=strict, context=context, trusted=trusted)
        return run_and_agree(model.world_comm, ckpt.lightning_dict, context=context)
    io = strategy.checkpoint_io
    read = None if type(io) is TorchCheckpointIO else lambda file: io.load_checkpoint(file, weights_only=weights_only)
    return load_full(path, model, strict=strict, trusted=trusted, read=read)


def load_model_state_dict(strategy: ZeRO3Strategy, checkpoint: Mapping[str, Any], strict: bool) -> None:
    state_dict = checkpoint["state_dict"]
    if isinstance(state_dict, ShardedStateDict):
        load_sharded_model(state_dict.checkpoint, strategy.sharded_model)
    else:
        strategy.sharded_model.load_full_state_dict(dict(state_dict), strict=strict)


def load_optimizer_state_dict(strategy: ZeRO3Strategy, checkpoint: Mapping[str, Any]) -> None:
    states = checkpoint["optimizer_states"]
    optimizers = strategy.optimizers
    if isinstance(states, ShardedOptimizerStates):
        load_sharded_optimizers(states.checkpoint, strategy.sharded_model, list(optimizers))
        return
    if len(states) != len(optimizers):
        raise CheckpointError(
            f"The checkpoint has state for {len(states)} optimizers but `configure_optimizers` returned "
            f"{len(optimizers)}; resume with the same optimizers."
        )
    for optimizer, state in zip(optimizers, states):
        load_full_optimizer_state(strategy.sharded_model, optimizer, state)


def remove_checkpoint(strategy: ZeRO3Strategy, filepath: str | Path) -> None:
    if not strategy.is_global_zero:
        return
    if not os.path.isdir(filepath) and type(strategy.checkpoint_io) is not TorchCheckpointIO:
        strategy.checkpoint_io.remove_checkpoint(filepath)  # a full file in the plugin's format
        return
    try:
        remove_checkpoint_path(filepath)  # a sharded directory, a file, or a link to either
    except CheckpointError as err:
        # Rank 0 only, as Lightning calls it: a warning, not an exception, keeps the ranks in
        # step; what is not a checkpoint stays (Note: what a save may replace).
        log.warning(str(err))
