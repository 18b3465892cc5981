"""Saving a sharded checkpoint: every rank writes its own pieces (nothing is gathered) into a
temporary directory, which rank 0 swaps into place once every rank's part is on disk."""

from __future__ import annotations

import contextlib
import os
import secrets
import warnings
from collections.abc import Mapping
from copy import deepcopy
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_zero3.checkpoint.background import BackgroundSave
from lightning_zero3.checkpoint.errors import CheckpointError, agree, describe_error, error_of, run_and_agree
from lightning_zero3.checkpoint.files import (
    Partial,
    check_replaceable,
    checksums,
    fsync_directory,
    own_meta,
    replace_path,
    write_json_atomically,
    write_synced,
)
from lightning_zero3.checkpoint.format import (
    DCP_INDEX_FILE,
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    TRAINER_STATE_FILE,
    Pieces,
    fingerprint,
    model_parameters,
    optimizer_param_names,
    param_numbers,
    sharded_by_name,
    tensor_json,
    with_params,
)
from lightning_zero3.checkpoint.remote import RemotePath, as_path
from lightning_zero3.checkpoint.trust import read_dcp_index
from lightning_zero3.engine import Comm, ShardedModel, ShardedParam

_LIGHTNING_KEYS = ("epoch", "global_step", "pytorch-lightning_version")  # copied into meta.json


def sharded_optimizer_state(model: ShardedModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with parameters named instead of numbered; shard-shaped state
    stays this rank's shard. No collective."""
    packed = optimizer.state_dict()
    groups = optimizer_param_names(model, optimizer)
    name_of = {number: name for name, number in param_numbers(groups).items()}
    state = {name_of[index]: dict(entry) for index, entry in packed["state"].items()}
    return {"state": state, "param_groups": with_params(packed["param_groups"], groups)}


@dataclass
class PlannedSave:
    """What a sharded save writes, planned on every rank: DCP's tensors, the pickled remainder
    (trainer_state.pt), and meta.json without its file list."""

    tensors: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    meta: dict[str, Any]


def plan_sharded(
    path: object, model: ShardedModel, checkpoint: Mapping[str, Any], *, copy: bool = False
) -> PlannedSave:
    """Plan the save of `checkpoint` (see `save_sharded`); `copy`: tensors and remainder copied to
    host memory, a snapshot training may go on from (Note: background saves). Every rank returns,
    or raises the same `CheckpointError`."""
    state_dict, optimizer_states = checkpoint["state_dict"], checkpoint.get("optimizer_states")
    lightning = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    pieces, sharded = Pieces(model), sharded_by_name(model)
    tensors: dict[str, torch.Tensor] = {}

    def store(dcp_key: str, value: torch.Tensor, sp: ShardedParam | None, piece: torch.Tensor | None) -> dict:
        """Put `value` (`piece` of the sharded parameter `sp`, or whole) in `tensors`; its meta.json entry."""
        if sp is not None and piece is not None:
            tensors[dcp_key] = pieces.sharded(piece.to("cpu", copy=True) if copy else piece, sp.numel)
            return {"kind": "sharded", **tensor_json(sp.whole_shape, value.dtype)}
        tensors[dcp_key] = value.detach().to("cpu", copy=True) if copy else value.detach()
        return {"kind": "tensor", **tensor_json(value.shape, value.dtype)}

    def plan() -> PlannedSave:
        entries: list[dict[str, Any]] = []
        state_objects: dict[str, Any] = {}
        for key, value in state_dict.items():
            sp = sharded.get(key)
            if not isinstance(value, torch.Tensor):
                state_objects[key] = value
                entries.append({"key": key, "kind": "object"})
            elif sp is not None and key != sp.name:
                entries.append({"key": key, "kind": "alias", "of": sp.name})
            elif sp is not None and value.numel() != sp.shard_numel:
                shard = f"this rank's shard has {sp.shard_numel}"
                raise CheckpointError(f"'{key}' has {value.numel()} elements but {shard}")
            else:
                piece = None if sp is None else value.detach().reshape(-1)[: sp.valid_numel()]
                entries.append({"key": key, **store(f"state_dict/{key}", value, sp, piece)})
        optimizers_meta, optimizers_objects = [], []
        by_first_name = {sp.name: sp for sp in model.sharded_params}
        for index, optim_state in enumerate(optimizer_states or []):
            state_meta: dict[str, dict[str, Any]] = {}
            state_objs: dict[str, dict[str, Any]] = {}
            for name, entry in optim_state["state"].items():
                sp = by_first_name.get(name)
                for k, v in entry.items():
                    if not isinstance(v, torch.Tensor):
                        state_objs.setdefault(name, {})[k] = v
                        continue
                    piece = v.detach()[: sp.valid_numel()] if sp is not None and sp.is_shard_shaped(v) else None
                    state_meta.setdefault(name, {})[k] = store(f"optimizer_states/{index}/{name}/{k}", v, sp, piece)
            optimizers_meta.append({"state": state_meta})
            optimizers_objects.append({"param_groups": optim_state["param_groups"], "state": state_objs})
        parameters = model_parameters(model)
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "world_size": model.world_comm.world_size,
            "shard_size": model.shard_comms[0].world_size,
            "torch_version": torch.__version__,
            "fingerprint": fingerprint(parameters),
            "parameters": parameters,
            "lightning": {k: lightning[k] for k in _LIGHTNING_KEYS if k in lightning},
            "state_dict": entries,
            "optimizers": optimizers_meta if optimizer_states is not None else None,
        }
        remainder: dict[str, Any] = {"keys": list(checkpoint), "extra": lightning, "state_dict": state_objects}
        remainder["optimizers"] = optimizers_objects
        return PlannedSave(tensors, deepcopy(remainder) if copy else remainder, meta)

    context = f"Saving the checkpoint {path} failed (any previous checkpoint there is unchanged)"
    return run_and_agree(model.world_comm, plan, context=context)


def save_sharded(path: str | os.PathLike | RemotePath, model: ShardedModel, checkpoint: Mapping[str, Any]) -> None:
    """Write `checkpoint` as a sharded checkpoint directory at `path` (every rank, the same path):
    its "state_dict" is the module's on this rank (its shards), its optional "optimizer_states" a
    list of `sharded_optimizer_state`s, other entries are kept as they are. Atomic (Note: temporary
    names in files.py); a `path` holding anything but a checkpoint is refused before anything is
    written (Note: what a save may replace)."""
    path = as_path(path)  # decided here once: a local path or a URL (Note: remote checkpoints)
    write_sharded(path, plan_sharded(path, model, checkpoint), model.world_comm)


def save_in_background(
    path: Path | RemotePath, model: ShardedModel, checkpoint: Mapping[str, Any], comm: Comm
) -> BackgroundSave:
    """`save_sharded` from a host snapshot (taken before it returns), in a thread, collectives on `comm` only."""
    planned = plan_sharded(path, model, checkpoint, copy=True)
    return BackgroundSave(lambda: write_sharded(path, planned, comm), what=f"the checkpoint {path}")


def write_sharded(path: Path | RemotePath, planned: PlannedSave, comm: Comm) -> None:
    """Write a planned save at `path` (see `save_sharded`), with collectives on `comm` only."""
    context = f"Saving the checkpoint {path} failed (any previous checkpoint there is unchanged)"
    mine: Partial | None = None  # rank 0's temporary directory (Note: temporary names in files.py)
    prefix: RemotePath | None = None  # rank 0's new prefix at a URL until committed (Note: remote checkpoints)
    try:

        def start() -> str | None:
            nonlocal mine, prefix
            if comm.rank != 0:
                return None
            check_replaceable(path)
            if isinstance(path, RemotePath):
                prefix = path / f"shards.{secrets.token_hex(8)}"
                return prefix.name
            mine = Partial(path, directory=True)
            return mine.path.name

        name, error = error_of(start)
        name = agree(comm, error, context=f"Cannot save the checkpoint {path}", share=name)[0]
        partial = path / name if isinstance(path, RemotePath) else path.with_name(name)  # rank 0's, beside `path`
        writer = _writer(partial)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(planned.tensors, storage_writer=writer, process_group=comm.group, no_dist=not comm.distributed)
        except (Exception, dcp.CheckpointException) as err:
            raise CheckpointError(f"{context}: writing the shards failed: {describe_error(err)}") from err
        own, error = error_of(lambda: checksums(partial, _rank_files(partial, comm.rank)))
        every = agree(comm, error, context=context, share=own)
        files = {name: info for part in every for name, info in part.items()}
        _, error = error_of(lambda: _finish(path, partial, files, planned)) if comm.rank == 0 else (None, None)
        # Rank 0 may be lost after its swap: the path then holds the old or the new checkpoint.
        lost = f"Saving the checkpoint {path} failed as rank 0 put it in place (it holds the previous or the new one)"
        agree(comm, error, context=context, if_lost=lost)
        prefix = None  # committed: meta.json names it
    finally:
        if mine is not None:
            mine.close(remove=True)
        if prefix is not None:
            with contextlib.suppress(Exception):  # best effort: unnamed by any meta.json, it is never read
                prefix.remove_prefix()


def _writer(directory: Path | RemotePath) -> dcp.FileSystemWriter:
    if isinstance(directory, RemotePath):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(str(directory), single_file_per_rank=True, sync_files=False, thread_count=1)
    return dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=1)


def _finish(
    path: Path | RemotePath, partial: Path | RemotePath, files: dict[str, dict[str, Any]], planned: PlannedSave
) -> None:
    """Rank 0, every rank's shards on disk: trainer_state.pt, meta.json, then the swap into `path`."""
    index = read_dcp_index(partial / DCP_INDEX_FILE, trusted=False)
    missing = sorted({info.relative_path for info in index.storage_data.values()} - set(files))
    if missing:
        raise CheckpointError(f"the DCP index names files no rank reported: {missing}")
    write_synced(partial / TRAINER_STATE_FILE, lambda f: torch.save(planned.trainer_state, f))
    files.update(checksums(partial, [DCP_INDEX_FILE, TRAINER_STATE_FILE]))
    meta = {**planned.meta, "files": files}
    if isinstance(path, RemotePath):
        assert isinstance(partial, RemotePath)
        _commit_manifest(path, partial, meta)
        return
    assert isinstance(path, Path) and isinstance(partial, Path)
    write_json_atomically(meta, partial / META_FILE)
    fsync_directory(partial)
    replace_path(partial, path)


def _commit_manifest(path: RemotePath, data: RemotePath, meta: dict[str, Any]) -> None:
    """At a URL the swap is one PUT of meta.json naming the new prefix, then what the previous one
    named is deleted: its prefix, or its files (one copied there whole) (Note: remote checkpoints)."""
    previous = own_meta(path) or {"files": {}}
    named = {previous["data"]} if isinstance(previous.get("data"), str) else set(previous["files"])
    write_json_atomically({**meta, "data": data.name}, path / META_FILE)
    for name in named - {data.name, META_FILE}:
        (path / name).remove()
    path.remove_object()  # a full file that was at the URL itself


def _rank_files(directory: Path | RemotePath, rank: int) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if fnmatch(p.name, f"__{rank}_*.distcp"))
