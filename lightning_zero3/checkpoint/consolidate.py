"""Consolidation: one ordinary checkpoint file from a sharded checkpoint directory, offline (no
process group, none of the ranks that wrote it), one tensor at a time.

[Note: streaming consolidation]
The output is written as it is read, one tensor at a time, so peak memory is about one tensor
plus one chunk; torch's `dcp_to_torch_save` loads the whole state first (docs/design.md,
streaming consolidation).
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_zero3.checkpoint.errors import CheckpointError, describe_error
from lightning_zero3.checkpoint.files import atomic_write, check_replaceable
from lightning_zero3.checkpoint.format import (
    ShardedCheckpoint,
    dtype_of,
    in_saved_order,
    numbered_optimizer_state,
    open_sharded,
)
from lightning_zero3.checkpoint.remote import RemotePath, as_path
from lightning_zero3.checkpoint.streaming import (
    Deferred,
    find_deferred,
    materialized,
    stream_safetensors,
    stream_torch_save,
)
from lightning_zero3.checkpoint.trust import CheckpointReader
from lightning_zero3.engine import parse_dtype


@dataclass
class Progress:
    """Tensors and bytes written so far, of the totals; passed to the `progress` callback."""

    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class ConsolidationSummary:
    src: Path | RemotePath
    dst: Path | RemotePath
    world_size: int
    tensors: int
    bytes: int
    file_bytes: int
    seconds: float

    def line(self) -> str:
        return (
            f"Consolidated {self.src} ({self.world_size} ranks) into {self.dst}: {self.tensors} tensors, "
            f"{self.bytes / 2**20:.1f} MiB of tensor data, {self.file_bytes / 2**20:.1f} MiB on disk, in "
            f"{self.seconds:.1f} s"
        )


def _deferred(reader: CheckpointReader, key: str, info: dict[str, Any], cast: torch.dtype | None = None) -> Deferred:
    """The tensor stored under `key`, read whole (chunk by chunk, flat if it was sharded) when written."""
    shape, dtype = tuple(info["shape"]), dtype_of(info["dtype"])
    stored = (math.prod(shape),) if info["kind"] == "sharded" else shape
    target = cast if cast is not None and dtype.is_floating_point else dtype

    def read() -> torch.Tensor:
        tensor = torch.empty(stored, dtype=dtype)
        reader.load({key: tensor})
        return tensor

    return Deferred(shape, target, read)


def deferred_checkpoint(
    ckpt: ShardedCheckpoint, *, weights_only: bool = False, cast: torch.dtype | None = None
) -> dict[str, Any]:
    """The Lightning checkpoint dict `ckpt` was saved from, in its saved key order, with every
    tensor a `Deferred` that reads it whole from the shards when materialized (tied weights:
    one `Deferred` under every name). `weights_only` leaves out optimizer states, LR schedulers
    and callback states; `cast` casts the floating-point tensors of the state dict."""
    trainer_state, reader = ckpt.trainer_state(), ckpt.reader
    state_dict: dict[str, Any] = OrderedDict()  # in the module's key order, tied weights under every name
    for entry in ckpt.meta["state_dict"]:
        key, kind = entry["key"], entry["kind"]
        if kind == "alias":
            state_dict[key] = state_dict[entry["of"]]
        elif kind == "object":
            state_dict[key] = trainer_state["state_dict"][key]
        else:
            state_dict[key] = _deferred(reader, f"state_dict/{key}", entry, cast)
    extra = dict(trainer_state["extra"])
    optimizer_states = None
    if weights_only:
        for key in ("lr_schedulers", "callbacks"):
            extra.pop(key, None)
    elif ckpt.meta["optimizers"] is not None:
        optimizer_states = []
        for i, (meta, saved) in enumerate(zip(ckpt.meta["optimizers"], trainer_state["optimizers"])):

            def tensor(name: str, k: str, info: dict[str, Any], i: int = i) -> Deferred:
                return _deferred(reader, f"optimizer_states/{i}/{name}/{k}", info)

            groups = [g["params"] for g in saved["param_groups"]]
            optimizer_states.append(numbered_optimizer_state(meta, saved, groups, tensor))
    return in_saved_order({**trainer_state, "extra": extra}, state_dict, optimizer_states)


def consolidate_checkpoint(
    src: str | os.PathLike | RemotePath,
    dst: str | os.PathLike | RemotePath,
    *,
    weights_only: bool = False,
    dtype: torch.dtype | str | None = None,
    safetensors: bool = False,
    verify: bool = True,
    progress: Callable[[Progress], None] | None = None,
    trusted: bool = False,
) -> ConsolidationSummary:
    """Write the sharded checkpoint `src` as one ordinary checkpoint file `dst` (what
    `state_dict_type="full"` writes), one tensor at a time (Note: streaming consolidation).
    `weights_only`: no optimizer states, LR schedulers or callback states; `dtype`: cast the
    state dict's floating-point tensors; `safetensors`: a safetensors file of the state dict;
    `verify`: check every CRC-32 first; `progress`: called after each tensor. Refused before
    anything is read: `dst` inside `src` (or `src`), and what a save may not replace. A failed
    write leaves at `dst` what was there."""
    start = time.perf_counter()
    src, dst = as_path(src), as_path(dst)
    cast = parse_dtype(dtype, "consolidate_checkpoint(dtype=...)")
    _check_destination(src, dst)
    ckpt = open_sharded(src, verify=verify, trusted=trusted)
    output = deferred_checkpoint(ckpt, weights_only=weights_only or safetensors, cast=cast)
    if safetensors:
        tensors = {k: v for k, v in output["state_dict"].items() if isinstance(v, Deferred)}
        extra = ckpt.trainer_state()["extra"]
        meta = {
            "format": "pt",
            "source": str(src),
            **{k: str(extra[k]) for k in ("epoch", "global_step") if k in extra},
        }
        unique = list(tensors.values())
    else:
        unique = list({id(t): t for t in find_deferred(output)}.values())
    done = Progress(0, len(unique), 0, sum(t.nbytes for t in unique))

    def on_tensor(nbytes: int) -> None:
        done.tensors_done += 1
        done.bytes_done += nbytes
        if progress is not None:
            progress(done)

    def write(file: Any) -> None:
        if safetensors:
            stream_safetensors(tensors, file, meta, on_tensor)
        else:
            stream_torch_save(output, file, on_tensor)

    try:  # the sync, the swap and the upload's commit fail as the writing does
        atomic_write(dst, write)  # at a URL the zip writer, unable to seek back, writes data descriptors
    except (CheckpointError, FileExistsError):  # FileExistsError: the temporary name is taken (refused as is)
        raise
    except Exception as err:
        raise CheckpointError(f"writing {dst} failed: {describe_error(err)}; nothing was written there") from err
    return ConsolidationSummary(
        src=src,
        dst=dst,
        world_size=ckpt.meta["world_size"],
        tensors=done.tensors_done,
        bytes=done.bytes_done,
        file_bytes=dst.stat().st_size,
        seconds=time.perf_counter() - start,
    )


def _check_destination(src: Path | RemotePath, dst: Path | RemotePath) -> None:
    real_src, real_dst = src.resolve(), dst.resolve()
    if real_dst == real_src or str(real_dst).startswith(str(real_src).rstrip("/") + "/"):
        where = "the checkpoint" if real_dst == real_src else "inside the checkpoint"
        raise CheckpointError(
            f"cannot write {dst}: it is {where} {src} being consolidated; choose a destination outside {src}"
        )
    if dst.is_dir():
        raise CheckpointError(f"cannot write {dst}: it is a directory")
    check_replaceable(dst)


__all__ = ["ConsolidationSummary", "Progress", "consolidate_checkpoint", "deferred_checkpoint", "materialized"]
