"""Full (single-file) checkpoints: the one writer and the one reader that the Trainer's and
Fabric's adapters, and `load_checkpoint`, use. A full file is an ordinary `torch.save` dict with
whole tensors, written by rank 0 and read by every rank."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_zero3.checkpoint.errors import CheckpointError, run_and_agree
from lightning_zero3.checkpoint.files import atomic_torch_save, few
from lightning_zero3.checkpoint.format import check_fits, model_tensors, tensor_json
from lightning_zero3.checkpoint.remote import RemotePath, as_path
from lightning_zero3.checkpoint.trust import load_torch_file
from lightning_zero3.engine import Comm, ShardedModel


def save_full(
    checkpoint: Mapping[str, Any],
    path: str | os.PathLike | RemotePath,
    comm: Comm,
    *,
    write: Callable[..., Any] | None = None,
) -> None:
    """Rank 0 writes `checkpoint` (whole tensors, already gathered to it) to the file `path`,
    atomically, or with `write(checkpoint, path)` (a `CheckpointIO` plugin's own save) if given;
    every rank returns, or raises the same `CheckpointError`."""

    def write_on_rank_0() -> None:
        if comm.rank == 0 and write is not None:
            write(checkpoint, path if isinstance(path, Path) else str(path))  # a plugin opens URLs itself
        elif comm.rank == 0:
            atomic_torch_save(checkpoint, path)

    context = f"Saving the checkpoint {path} failed (any previous checkpoint there is unchanged)"
    run_and_agree(comm, write_on_rank_0, context=context)


def load_full(
    path: str | os.PathLike | RemotePath,
    model: ShardedModel,
    *,
    key: str | None = "state_dict",
    strict: bool,
    trusted: bool,
    read: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """`read_full_file` on every rank, checked to fit `model`: its entry `key` (the whole dict when
    None) has the model's names (with `strict`) and shapes. Every rank returns it, or raises the
    same `CheckpointError`."""

    def read_checked() -> dict[str, Any]:
        checkpoint = read_full_file(path, key=key, trusted=trusted, read=read)
        state_dict = checkpoint if key is None else checkpoint[key]
        saved = {k: tensor_json(v.shape, v.dtype) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        check_fits(path, saved, model_tensors(model), strict=strict)
        return checkpoint

    return run_and_agree(model.world_comm, read_checked, context=f"Cannot load the checkpoint {path}")


def read_full_file(
    path: str | os.PathLike | RemotePath,
    *,
    key: str | None = "state_dict",
    trusted: bool,
    read: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """The dict saved in the file `path`, with an entry `key` unless None: read with `read` if
    given, else by `load_torch_file` (memory-mapped)."""
    path = as_path(path)
    if read is not None:
        checkpoint = read(path if isinstance(path, Path) else str(path))
    elif not path.exists():
        raise CheckpointError(f"{path} does not exist")
    elif path.is_dir():
        raise CheckpointError(
            f"{path} is a directory, not a checkpoint file: a sharded checkpoint is loaded with `load_sharded` (on "
            f"every rank) or, in one process, with `lightning_zero3.load_checkpoint` / `load_from_checkpoint`"
        )
    else:
        checkpoint = load_torch_file(path, trusted=trusted, mmap=True)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    if key is None or key in checkpoint:
        return checkpoint
    if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        raise CheckpointError(
            f"{path} is a plain state dict, not a checkpoint with an entry '{key}': to start from it, load it into the "
            f"model before fit (`model.load_state_dict(torch.load(path))`; with Fabric, `fabric.load_raw(path, model)`)"
        )
    raise CheckpointError(f"{path} has no entry '{key}' (it has {few(sorted(map(str, checkpoint)))})")
