"""The sharded checkpoint format: its layout on disk, how the live model and its shards map to
it, and reading a checkpoint directory back with every check done before any data is read.

[Note: sharded checkpoint layout]
A directory: meta.json written last, so its presence marks a complete checkpoint, beside
trainer_state.pt and DCP's files, each tensor stored flat as DCP's Shard(0) chunks, which are
exactly our unpadded shards (docs/design.md, sharded checkpoint layout).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch

from lightning_zero3.checkpoint.errors import CheckpointError, run_and_agree
from lightning_zero3.checkpoint.files import FORMAT, META_FILE, crc32, few
from lightning_zero3.checkpoint.remote import DATA_PREFIX, RemotePath, as_path
from lightning_zero3.checkpoint.trust import (
    CheckpointReader,
    check_meta,
    check_plain_name,
    check_trainer_state,
    load_torch_file,
    read_dcp_index,
)
from lightning_zero3.engine import Comm, ShardedModel, ShardedParam

FORMAT_VERSION = 1
TRAINER_STATE_FILE = "trainer_state.pt"
DCP_INDEX_FILE = ".metadata"


def tensor_json(shape: Iterable[int], dtype: torch.dtype) -> dict[str, Any]:
    """A tensor's whole shape and dtype, as meta.json records them."""
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def sharded_by_name(model: ShardedModel) -> dict[str, ShardedParam]:
    return {name: sp for sp in model.sharded_params for name in sp.names}


def model_tensors(model: ShardedModel) -> dict[str, dict[str, Any]]:
    """`tensor_json` of every tensor in the module's state dict, sharded or not."""
    sharded = sharded_by_name(model)
    out = {}
    for key, value in model.module.state_dict().items():
        if key in sharded:
            out[key] = tensor_json(sharded[key].whole_shape, sharded[key].param.dtype)
        elif isinstance(value, torch.Tensor):
            out[key] = tensor_json(value.shape, value.dtype)
    return out


def model_parameters(model: ShardedModel) -> dict[str, dict[str, Any]]:
    """`tensor_json` of every parameter, tied ones under each name."""
    out = {name: tensor_json(sp.whole_shape, sp.param.dtype) for sp in model.sharded_params for name in sp.names}
    for name, param in model.module.named_parameters(remove_duplicate=False):
        out.setdefault(name, tensor_json(param.shape, param.dtype))
    return out


def fingerprint(parameters: Mapping[str, Mapping[str, Any]]) -> str:
    """A hash of the parameter names and whole shapes: equal for checkpoints of the same model."""
    text = "\n".join(f"{name}:{tuple(info['shape'])}" for name, info in sorted(parameters.items()))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def check_fits(
    path: object, saved: Mapping[str, Mapping[str, Any]], expected: Mapping[str, Mapping[str, Any]], *, strict: bool
) -> None:
    """Raise unless a checkpoint holding `saved` tensors can load into a model holding `expected`
    (`tensor_json`s), naming names on one side only (when `strict`) and shapes that differ."""
    shape = {k: tuple(v["shape"]) for k, v in saved.items()}
    shapes = [k for k in expected if k in shape and shape[k] != tuple(expected[k]["shape"])]
    problems = [
        f"'{k}' has shape {shape[k]} in the checkpoint but {tuple(expected[k]['shape'])} in the model"
        for k in shapes[:10]
    ]
    missing, unexpected = [k for k in expected if k not in saved], [k for k in saved if k not in expected]
    if strict and missing:
        problems.append(f"{len(missing)} keys of the model are not in the checkpoint: {few(missing)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} keys of the checkpoint are not in the model: {few(unexpected)}")
    if len(shapes) > 10:
        problems.append(f"and {len(shapes) - 10} more shape differences")
    if problems:
        fix = ", or set strict_loading=False" if strict else ""
        raise CheckpointError(
            f"checkpoint {path} holds another model: {'; '.join(problems)}. Load a checkpoint of this model{fix}."
        )


def optimizer_param_names(model: ShardedModel, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The first name of each parameter of each param group: shards and parameters the module
    registers whole."""
    names = {id(sp.param): sp.name for sp in model.sharded_params}
    for name, param in model.module.named_parameters():
        names.setdefault(id(param), name)
    groups = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise CheckpointError(
                f"optimizer {type(optimizer).__name__} holds parameters that are not in the model (shapes "
                f"{missing[:4]}); a sharded checkpoint names optimizer state by parameter name."
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def param_numbers(groups: Iterable[Iterable[str]]) -> dict[str, int]:
    """Parameter name -> its number in `optimizer.state_dict()` (0, 1, ... in param_groups order),
    from the parameter names of each group."""
    return {name: i for i, name in enumerate(name for group in groups for name in group)}


def with_params(param_groups: Iterable[Mapping[str, Any]], params: Iterable[list[Any]]) -> list[dict[str, Any]]:
    """`param_groups` with each group's "params" replaced by the matching list of `params`."""
    return [{**group, "params": list(ps)} for group, ps in zip(param_groups, params)]


def numbered_optimizer_state(
    meta: dict[str, Any], saved: dict[str, Any], groups: list[list[str]], tensor: Callable[[str, str, dict], Any]
) -> dict[str, Any]:
    """One optimizer's `state_dict()` as torch numbers it (in the order of `groups`, the parameter
    names of each param group): the non-tensor state `saved` in trainer_state.pt, and
    `tensor(name, key, info)` for each state tensor `meta` (its meta.json entry) lists."""
    order = param_numbers(groups)
    state: dict[int, dict[str, Any]] = {}
    for name in sorted(set(meta["state"]) | set(saved["state"]), key=order.__getitem__):
        entry = state[order[name]] = dict(saved["state"].get(name, {}))
        for k, info in meta["state"].get(name, {}).items():
            entry[k] = tensor(name, k, info)
    numbers = ([order[n] for n in names] for names in groups)
    return {"state": state, "param_groups": with_params(saved["param_groups"], numbers)}


class Pieces:
    """Builds the DCP state dict of one rank: a sharded tensor is a DTensor over its unpadded local
    piece (Note: sharded checkpoint layout), on a 1-D mesh, or with hierarchical sharding a 2-D
    (replica, shard) mesh with placements (Replicate(), Shard(0)) so that DCP writes each chunk once."""

    def __init__(self, model: ShardedModel) -> None:
        self.model = model
        self._meshes: dict[str, Any] = {}  # device type -> mesh

    def sharded(self, piece: torch.Tensor, numel: int) -> torch.Tensor:
        if not self.model.world_comm.distributed:
            return piece  # one process: the piece is the whole flat tensor
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        (shard, replicate), kind = self.model.shard_comms, piece.device.type
        assert shard.group is not None  # distributed: every Comm has its group
        if kind not in self._meshes and replicate is None:
            self._meshes[kind] = DeviceMesh.from_group(shard.group, kind)
        elif kind not in self._meshes and replicate is not None and replicate.group is not None:
            layout = torch.arange(self.model.world_comm.world_size).reshape(replicate.world_size, shard.world_size)
            groups = [replicate.group, shard.group]
            self._meshes[kind] = DeviceMesh.from_group(groups, kind, mesh=layout, mesh_dim_names=("replicate", "shard"))
        placements = [Shard(0)] if replicate is None else [Replicate(), Shard(0)]
        return DTensor.from_local(
            piece, self._meshes[kind], placements, run_check=False, shape=torch.Size([numel]), stride=(1,)
        )


class ShardedCheckpoint:
    """A sharded checkpoint directory whose meta.json, DCP index and trainer_state.pt were read
    and checked; `reader` reads its tensors."""

    def __init__(self, path: Path | RemotePath, meta: dict[str, Any], *, reader: CheckpointReader, saved: dict) -> None:
        self.path = path
        self.meta = meta
        self.reader = reader
        self._saved = saved
        self._entries: dict[str, dict[str, Any]] = {e["key"]: e for e in meta["state_dict"]}

    def kind(self, key: str) -> str | None:
        """How `key` was stored: "sharded", "tensor", "alias", "object", or None if absent."""
        entry = self._entries.get(key)
        return entry["kind"] if entry is not None else None

    def tensors(self) -> dict[str, dict[str, Any]]:
        """`tensor_json` of every state-dict tensor, aliases included."""
        sources = {key: self._entries[e["of"]] if e["kind"] == "alias" else e for key, e in self._entries.items()}
        return {key: source for key, source in sources.items() if source["kind"] != "object"}

    def stored_key(self, names: Iterable[str]) -> str | None:
        """The key under which a parameter known by `names` was stored (its first saved name)."""
        entry = next((self._entries[n] for n in names if n in self._entries), None)
        return None if entry is None else entry["of"] if entry["kind"] == "alias" else entry["key"]

    def trainer_state(self) -> dict[str, Any]:
        """trainer_state.pt: the checkpoint dict's "keys" in order, its "extra" entries, the state
        dict's non-tensor entries, the optimizers' param_groups and non-tensor state."""
        return dict(self._saved)

    def lightning_dict(self) -> dict[str, Any]:
        """The checkpoint dict Lightning saved, without reading a tensor: "state_dict" is a
        `ShardedStateDict` of meta tensors, "optimizer_states" a `ShardedOptimizerStates`."""
        state_dict = ShardedStateDict(self)
        for key, info in self.tensors().items():
            state_dict[key] = torch.empty(info["shape"], dtype=dtype_of(info["dtype"]), device="meta")
        state_dict.update(self._saved["state_dict"])
        optimizer_states = None
        if self.meta["optimizers"] is not None:
            optimizer_states = ShardedOptimizerStates(self, self._saved["optimizers"])
        return in_saved_order(self._saved, state_dict, optimizer_states)


def in_saved_order(saved: dict[str, Any], state_dict: Any, optimizer_states: Any | None) -> dict[str, Any]:
    """The checkpoint dict from trainer_state.pt's entries and these, its keys in the saved order."""
    parts = {**saved["extra"], "state_dict": state_dict}
    if optimizer_states is not None:
        parts["optimizer_states"] = optimizer_states
    return {key: parts[key] for key in saved["keys"] if key in parts}


class ShardedStateDict(dict):
    """A state dict still on disk: the keys and shapes (meta tensors) of a sharded checkpoint."""

    def __init__(self, checkpoint: ShardedCheckpoint) -> None:
        super().__init__()
        self.checkpoint = checkpoint


class ShardedOptimizerStates(list):
    """Optimizer states still on disk: param_groups (parameters by name) of a sharded checkpoint."""

    def __init__(self, checkpoint: ShardedCheckpoint, saved: list[dict[str, Any]]) -> None:
        super().__init__(saved)
        self.checkpoint = checkpoint


def open_sharded(
    path: str | os.PathLike | RemotePath, *, comm: Comm | None = None, verify: bool = True, trusted: bool = False
) -> ShardedCheckpoint:
    """Read and check a sharded checkpoint: meta.json, every file's presence and size, the CRC-32
    of files r, r + N, ... on rank r (all without `comm`), DCP's index; ranks agree on the outcome."""
    path = as_path(path)
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)

    def check() -> ShardedCheckpoint:
        meta = _read_meta(path)
        data = data_directory(path, meta)
        names = sorted(meta["files"])
        for name in names:
            _check_file(data, name, meta["files"][name], crc=False)
        if verify:
            for name in names[rank::world]:
                _check_file(data, name, meta["files"][name], crc=True)
        index = read_dcp_index(data / DCP_INDEX_FILE, trusted=trusted)
        unlisted = sorted({info.relative_path for info in index.storage_data.values()} - set(names))
        if unlisted:
            raise CheckpointError(f"{data / DCP_INDEX_FILE} names files that {META_FILE} does not list: {unlisted}")
        file = data / TRAINER_STATE_FILE
        saved = dict(check_trainer_state(load_torch_file(file, trusted=trusted), file))
        return ShardedCheckpoint(path, meta, reader=CheckpointReader(data, index=index), saved=saved)

    return run_and_agree(comm, check, context=f"Cannot load the checkpoint {path}")


def data_directory(path: Path | RemotePath, meta: Mapping[str, Any]) -> Path | RemotePath:
    """Where meta.json's files are: next to it, or in the prefix it names (Note: remote checkpoints)."""
    data = meta.get("data")
    if data is None:
        return path
    if not isinstance(data, str) or DATA_PREFIX.fullmatch(data) is None:
        raise CheckpointError(f"{path / META_FILE} is corrupted: 'data' must name a 'shards.<16 hex digits>' prefix")
    check_plain_name(path, data, str(path / META_FILE))
    return path / data


def _read_meta(path: Path | RemotePath) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint directory")
    meta_file = path / META_FILE
    check_plain_name(path, META_FILE, str(path))  # a link out of the directory is not read
    if not meta_file.is_file():
        saved = [p.name for p in path.iterdir() if DATA_PREFIX.fullmatch(p.name) or fnmatch(p.name, "__*_*.distcp")]
        if (path / DCP_INDEX_FILE).exists() or saved:
            raise CheckpointError(
                f"{path} has shard files but no {META_FILE}: the save that wrote it did not finish, or it was "
                f"not written by lightning_zero3; it is not a complete checkpoint"
            )
        raise CheckpointError(f"{path} is not a checkpoint: it has no {META_FILE}")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{meta_file} is corrupted: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a lightning_zero3 checkpoint: {META_FILE} has no format '{FORMAT}'")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}, but this lightning_zero3 reads version "
            f"{FORMAT_VERSION}; use the lightning_zero3 version that wrote it (or a newer one)"
        )
    for key in ("world_size", "state_dict", "optimizers", "files", "parameters", "fingerprint"):
        if key not in meta:
            raise CheckpointError(f"{meta_file} is corrupted: it has no '{key}'")
    check_meta(meta, meta_file)
    return meta


def _check_file(directory: Path | RemotePath, name: str, expected: Mapping[str, Any], *, crc: bool) -> None:
    check_plain_name(directory, name, str(directory / META_FILE))  # before the name touches the disk
    file = directory / name
    what = f"rank {expected['rank']}'s shard file" if "rank" in expected else "file"
    if not file.is_file():
        raise CheckpointError(f"{what} {file} is missing")
    size = file.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{what} {file} is truncated or damaged: {size} bytes, expected {expected['bytes']}")
    if crc:
        actual = crc32(file)
        if actual != expected["crc32"]:
            raise CheckpointError(
                f"{what} {file} is corrupted: CRC-32 {actual} does not match {expected['crc32']} in {META_FILE}"
            )
