"""Checkpoints for ZeRO-3: sharded directories saved by every rank without gathering, loaded at
any world size, replaced on disk atomically, and consolidated offline into one ordinary file.
Framework-independent (no Lightning import): a Lightning checkpoint is only a dict here.

    format.py       the on-disk layout [Note: sharded checkpoint layout]; reading and checking it
    save.py         save_sharded: every rank writes its pieces; rank 0 swaps the directory in
    load.py         load_sharded (model and optimizers, at this run's world size), full files
    consolidate.py  one ordinary checkpoint file from a sharded directory, one tensor at a time
    plain.py        either kind read into one process: load_checkpoint (a dict), load_from_checkpoint
    files.py        checksums, synced writes, atomic replace and remove [Note: what a save may replace]
    trust.py        what loading trusts: restricted unpickling, plain names [Note: checkpoint trust model]
    errors.py       CheckpointError; ranks agree before any collective [Note: no hang on a bad checkpoint]
"""

from lightning_zero3.checkpoint.consolidate import ConsolidationSummary, Progress, consolidate_checkpoint
from lightning_zero3.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    all_gather_object,
    raise_if,
    require_exists,
    run_and_agree,
)
from lightning_zero3.checkpoint.files import atomic_torch_save, remove_checkpoint
from lightning_zero3.checkpoint.format import (
    FORMAT_VERSION,
    ShardedCheckpoint,
    ShardedOptimizerStates,
    ShardedStateDict,
    TensorInfo,
    describe_mismatch,
    fingerprint,
    is_sharded_checkpoint,
    model_tensors,
    open_sharded,
)
from lightning_zero3.checkpoint.load import (
    check_loadable,
    check_state_dict_loadable,
    load_full_file,
    load_sharded,
    load_sharded_model,
    load_sharded_optimizers,
    open_checked,
)
from lightning_zero3.checkpoint.plain import load_checkpoint, load_from_checkpoint
from lightning_zero3.checkpoint.save import save_sharded, sharded_optimizer_state

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConsolidationSummary",
    "Progress",
    "ShardedCheckpoint",
    "ShardedOptimizerStates",
    "ShardedStateDict",
    "TensorInfo",
    "all_gather_object",
    "require_exists",
    "atomic_torch_save",
    "check_loadable",
    "open_checked",
    "raise_if",
    "check_state_dict_loadable",
    "consolidate_checkpoint",
    "describe_mismatch",
    "fingerprint",
    "is_sharded_checkpoint",
    "load_checkpoint",
    "load_from_checkpoint",
    "load_full_file",
    "load_sharded",
    "load_sharded_model",
    "load_sharded_optimizers",
    "model_tensors",
    "open_sharded",
    "remove_checkpoint",
    "run_and_agree",
    "save_sharded",
    "sharded_optimizer_state",
]
