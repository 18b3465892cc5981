"""Checkpoints for ZeRO-3 (no Lightning import: a Lightning checkpoint is only a dict here).

format.py       the on-disk layout [Note: sharded checkpoint layout]; reading and checking it
save.py         save_sharded: every rank writes its pieces; rank 0 swaps the directory in
load.py         load_sharded (model and optimizers, at this run's world size)
full.py         save_full / load_full: the one writer and reader of single-file checkpoints
consolidate.py  one file from a sharded directory, a tensor at a time [Note: streaming consolidation]
streaming.py    the writers consolidation streams through [Note: the torch.save file format]
plain.py        either kind read into one process [Note: loading into a plain module]
files.py        checksums, atomic replace and remove [Note: temporary names]
remote.py       fsspec URLs, manifest-last commit [Note: remote checkpoints]
trust.py        restricted unpickling, plain names [Note: checkpoint trust model]
errors.py       CheckpointError; ranks agree before any collective [Note: no hang on a bad checkpoint]
background.py   saves written in a thread [Note: background saves]
"""

# The door: users' names, then the glue's (nothing outside imports a module: tests/engine/test_engine_imports.py).
from lightning_zero3.checkpoint.background import BackgroundSave, saver_comm
from lightning_zero3.checkpoint.consolidate import Progress, consolidate_checkpoint
from lightning_zero3.checkpoint.errors import CheckpointError, CheckpointNotFoundError, agree, describe_error
from lightning_zero3.checkpoint.files import remove_checkpoint
from lightning_zero3.checkpoint.format import ShardedStateDict
from lightning_zero3.checkpoint.full import load_full, save_full
from lightning_zero3.checkpoint.load import load_model_state, load_optimizer_states, load_sharded, open_checkpoint
from lightning_zero3.checkpoint.plain import load_checkpoint, load_from_checkpoint
from lightning_zero3.checkpoint.remote import RemotePath, as_path
from lightning_zero3.checkpoint.save import save_in_background, save_sharded, sharded_optimizer_state

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
    # the glue's
    "BackgroundSave",
    "RemotePath",
    "ShardedStateDict",
    "agree",
    "as_path",
    "describe_error",
    "load_model_state",
    "load_optimizer_states",
    "open_checkpoint",
    "save_in_background",
    "saver_comm",
]
