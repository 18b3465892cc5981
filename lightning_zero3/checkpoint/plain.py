"""A checkpoint of either kind read into one process, without a process group: the Lightning
checkpoint dict with whole tensors, or a LightningModule built from it.

[Note: loading into a plain module]
The default checkpoint (`state_dict_type="sharded"`) is a directory, which `torch.load` and
Lightning's `LightningModule.load_from_checkpoint` cannot open (they raise IsADirectoryError).
`load_checkpoint` reads it the way consolidation does (Note: streaming consolidation): one tensor
at a time, each read whole from the chunks the ranks saved, so that peak memory is the result
plus one chunk; a full file is read as `torch.load` reads it. `load_from_checkpoint` hands that
dict to Lightning's own `load_from_checkpoint` (an in-memory file), so hyper-parameters,
`hparams_file`, keyword overrides, `on_load_checkpoint` and `strict` behave exactly as Lightning
defines them. Both follow the trust model (Note: checkpoint trust model): restricted unpickling
unless `trusted=True`.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, TypeVar

import torch

from lightning_zero3.checkpoint.consolidate import deferred_checkpoint
from lightning_zero3.checkpoint.errors import CheckpointError
from lightning_zero3.checkpoint.format import open_sharded
from lightning_zero3.checkpoint.full import read_full_file
from lightning_zero3.checkpoint.streaming import materialized

ModuleT = TypeVar("ModuleT")
_LIGHTNING_VERSION_KEY = "pytorch-lightning_version"  # every checkpoint a Trainer saves has it


def load_checkpoint(
    path: str | os.PathLike, *, weights_only: bool = False, trusted: bool = False, verify: bool = True
) -> dict[str, Any]:
    """The Lightning checkpoint dict saved at `path`, in this process, with whole tensors on the
    CPU: "state_dict" (the LightningModule's keys; tied weights share one tensor),
    "hyper_parameters", "epoch", "global_step", "optimizer_states" (numbered as
    `optimizer.state_dict()` numbers them), "lr_schedulers", "callbacks", ..., as far as the
    checkpoint holds them. `path` is a sharded checkpoint directory (saved at any number of
    ranks; e.g. `ModelCheckpoint.best_model_path` under `strategy="zero3"`) or a full checkpoint
    file. No process group is needed; a sharded checkpoint is read one tensor at a time
    (Note: loading into a plain module).

    Args:
        weights_only: leave out optimizer states, LR schedulers and callback states (they are
            then never read).
        trusted: unpickle the checkpoint's pickles without restriction (Note: checkpoint trust
            model); only for checkpoints from a trusted source.
        verify: check every shard file's CRC-32 against meta.json first.

    Raises:
        CheckpointError: naming the path and the problem (missing, damaged, not a checkpoint, a
            pickle that could run code).
    """
    if Path(path).is_dir():  # a directory of another kind: the CheckpointError says what it lacks
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
    """`cls.load_from_checkpoint(path, ...)` for a checkpoint of either kind: a sharded
    directory (the default under `strategy="zero3"`, e.g. `ModelCheckpoint.best_model_path`) or
    a full file. Builds `cls` from the checkpoint's hyper-parameters (overridden by `kwargs`)
    and loads its weights, strictly unless `strict=False` (or `cls.strict_loading` is False),
    in one process without a process group; `map_location`, `hparams_file` and `kwargs` mean
    what they mean in Lightning's `load_from_checkpoint`. `trusted` as in `load_checkpoint`.

    A sharded checkpoint is read one tensor at a time into an in-memory file that Lightning then
    loads (Note: loading into a plain module): peak memory is about three times the weights (the
    module Lightning builds, the in-memory file, the tensors loaded from it), against about twice
    for Lightning's own load of a file. For a model too large for that, build it yourself and load
    `load_checkpoint(path, weights_only=True)["state_dict"]` into it."""
    options: dict[str, Any] = {"map_location": map_location, "hparams_file": hparams_file, "strict": strict}
    options["weights_only"] = not trusted
    source: str | os.PathLike | io.BytesIO = path
    if Path(path).is_dir():
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
