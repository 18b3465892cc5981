"""A checkpoint of either kind read into one process, without a process group: the Lightning
checkpoint dict with whole tensors, or a LightningModule built from it.

[Note: loading into a plain module]
`torch.load` cannot open a sharded directory: `load_checkpoint` reads it one tensor at a time and
`load_from_checkpoint` hands the dict to Lightning's own (docs/design.md, loading into a plain
module).
"""

from __future__ import annotations

import io
import os
from typing import Any, TypeVar

import torch

from lightning_zero3.checkpoint.consolidate import deferred_checkpoint
from lightning_zero3.checkpoint.errors import CheckpointError
from lightning_zero3.checkpoint.format import open_sharded
from lightning_zero3.checkpoint.full import read_full_file
from lightning_zero3.checkpoint.remote import as_path
from lightning_zero3.checkpoint.streaming import materialized

ModuleT = TypeVar("ModuleT")
_LIGHTNING_VERSION_KEY = "pytorch-lightning_version"  # every checkpoint a Trainer saves has it


def load_checkpoint(
    path: str | os.PathLike, *, weights_only: bool = False, trusted: bool = False, verify: bool = True
) -> dict[str, Any]:
    """The Lightning checkpoint dict saved at `path` (a sharded directory or a full file) with whole
    tensors on the CPU, in this process: "state_dict" (tied weights share one tensor),
    "optimizer_states" (numbered as `optimizer.state_dict()` numbers them), the rest as saved.
    `weights_only`: leave out (never read) optimizer states, LR schedulers and callback states;
    `trusted`: unpickle without restriction; `verify`: check every file's CRC-32 first."""
    if as_path(path).is_dir():  # a directory of another kind: the CheckpointError says what it lacks
        ckpt = open_sharded(path, verify=verify, trusted=trusted)
        return materialized(deferred_checkpoint(ckpt, weights_only=weights_only))
    checkpoint = read_full_file(path, trusted=trusted)
    if weights_only:
        for key in ("optimizer_states", "lr_schedulers", "callbacks"):
            checkpoint.pop(key, None)
    return checkpoint


def load_from_checkpoint(
    cls: type[ModuleT],
    path: str | os.PathLike,
    *,
    map_location: Any = None,
    hparams_file: str | os.PathLike | None = None,
    strict: bool | None = None,
    trusted: bool = False,
    **kwargs: Any,
) -> ModuleT:
    """`cls.load_from_checkpoint(path, ...)` for a checkpoint of either kind, in one process:
    the arguments mean what they mean to Lightning; `trusted` as in `load_checkpoint`. A sharded
    checkpoint goes through an in-memory file (Note: loading into a plain module): peak memory is
    about three times the weights. For a model too large for that, build it yourself and load
    `load_checkpoint(path, weights_only=True)["state_dict"]` into it."""
    options: dict[str, Any] = {"map_location": map_location, "hparams_file": hparams_file, "strict": strict}
    options["weights_only"] = not trusted
    source: str | os.PathLike | io.BytesIO = path
    if as_path(path).is_dir():
        checkpoint = load_checkpoint(path, weights_only=True, trusted=trusted)
        if _LIGHTNING_VERSION_KEY not in checkpoint:  # Lightning's migration reads it first
            raise CheckpointError(
                f"{path} was not saved by Lightning's Trainer (it has no '{_LIGHTNING_VERSION_KEY}'), so "
                f"`load_from_checkpoint` cannot build a LightningModule from it: build the module yourself and load "
                f"`lightning_zero3.load_checkpoint(path)['state_dict']` into it"
            )
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        del checkpoint
        buffer.seek(0)
        source = buffer
    return cls.load_from_checkpoint(source, **options, **kwargs)  # type: ignore[attr-defined]


__all__ = ["load_checkpoint", "load_from_checkpoint"]
