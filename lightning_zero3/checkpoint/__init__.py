"""Checkpoints for ZeRO-3: sharded directories saved by every rank without gathering, loaded at
any world size, replaced on disk atomically, and consolidated offline into one ordinary file.
Framework-independent (no Lightning import): a Lightning checkpoint is only a dict here.

    format.py       the on-disk layout [Note: sharded checkpoint layout]; reading and checking it
    save.py         save_sharded: every rank writes its pieces; rank 0 swaps the directory in
    load.py         load_sharded (model and optimizers, at this run's world size)
    full.py         save_full / load_full: the one writer and reader of single-file checkpoints
    consolidate.py  one ordinary checkpoint file from a sharded directory, one tensor at a time
    streaming.py    the writers consolidation streams through [Note: the torch.save file format]
    plain.py        either kind read into one process: load_checkpoint (a dict), load_from_checkpoint
    files.py        checksums, atomic replace and remove, temporary names [Note: temporary names]
    remote.py       fsspec URLs: a Path-like handle, manifest-last commit [Note: remote checkpoints]
    trust.py        what loading trusts: restricted unpickling, plain names [Note: checkpoint trust model]
    errors.py       CheckpointError; ranks agree before any collective [Note: no hang on a bad checkpoint]
"""

from lightning_zero3.checkpoint.consolidate import Progress, consolidate_checkpoint
from lightning_zero3.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from lightning_zero3.checkpoint.files import remove_checkpoint
from lightning_zero3.checkpoint.full import load_full, save_full
from lightning_zero3.checkpoint.load import load_sharded
from lightning_zero3.checkpoint.plain import load_checkpoint, load_from_checkpoint
from lightning_zero3.checkpoint.save import save_sharded, sharded_optimizer_state

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "Progress",
    "consolidate_checkpoint",
    "load_checkpoint",
    "load_from_checkpoint",
    "load_full",
    "load_sharded",
    "remove_checkpoint",
    "save_full",
    "save_sharded",
    "sharded_optimizer_state",
]
