"""The sharded checkpoint format: its layout on disk, how the live model and its shards map to
it, and reading a checkpoint directory back with every check done before any data is read.

[Note: sharded checkpoint layout]
A sharded checkpoint is a directory: meta.json (written last, so its presence marks a complete
checkpoint: format and version, world size, every tensor's full shape and dtype, a fingerprint
of the parameter names and shapes, each file's size and CRC-32), trainer_state.pt (everything
that is not a tensor: the rest of the checkpoint dict, optimizer param_groups by parameter name,
non-tensor optimizer state), and DCP's index `.metadata` and files `__<r>_0.distcp` (rank r's
chunks). DCP keys: `state_dict/<name>` (a tied parameter once, under its first name; the other
names are aliases in meta.json) and `optimizer_states/<i>/<name>/<key>`. A sharded tensor is
stored flat, as a 1-D DTensor with placement Shard(0): `torch.chunk` gives rank r elements
[r * ceil(n/N), min((r + 1) * ceil(n/N), n)), exactly the unpadded part of our shard (Note:
shard layout in engine/shard.py). With `shard_size` the mesh is 2-D (replica, shard) with
placements (Replicate(), Shard(0)), and DCP writes each chunk once. Loading at another world
size asks DCP for the new slice of the flat tensor; it reads the overlapping chunks. Replicated
tensors (buffers, persistent parameters, optimizer steps) are plain tensors, written once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_zero3.checkpoint.errors import CheckpointError, agree, error_of
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
from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.model import ShardedModel
from lightning_zero3.engine.shard import ShardedParam

FORMAT_VERSION = 1
TRAINER_STATE_FILE = "trainer_state.pt"
DCP_INDEX_FILE = ".metadata"


# ---- the live model, as a checkpoint sees it ------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str

    def as_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def sharded_by_name(model: ShardedModel) -> dict[str, ShardedParam]:
    return {name: sp for sp in model.sharded_params for name in sp.names}


def model_tensors(model: ShardedModel) -> dict[str, TensorInfo]:
    """Full shape and dtype of every tensor in the module's state dict, sharded or not."""
    sharded = sharded_by_name(model)
    out = {}
    for key, value in model.module.state_dict().items():
        if key in sharded:
            sp = sharded[key]
            out[key] = TensorInfo(tuple(sp.full_shape), dtype_name(sp.param.dtype))
        elif isinstance(value, torch.Tensor):
            out[key] = TensorInfo(tuple(value.shape), dtype_name(value.dtype))
    return out


def model_parameters(model: ShardedModel) -> dict[str, TensorInfo]:
    """Every parameter name (tied ones under each name) with its full shape and dtype."""
    out = {
        name: TensorInfo(tuple(sp.full_shape), dtype_name(sp.param.dtype))
        for sp in model.sharded_params
        for name in sp.names
    }
    for name, param in model.module.named_parameters(remove_duplicate=False):
        out.setdefault(name, TensorInfo(tuple(param.shape), dtype_name(param.dtype)))
    return out


def fingerprint(parameters: Mapping[str, TensorInfo]) -> str:
    """A hash of the parameter names and full shapes: equal for checkpoints of the same model."""
    text = "\n".join(f"{name}:{info.shape}" for name, info in sorted(parameters.items()))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def describe_mismatch(
    path: str | os.PathLike | RemotePath,
    saved: Mapping[str, TensorInfo],
    expected: Mapping[str, TensorInfo],
    *,
    strict: bool,
) -> str | None:
    """Why a checkpoint holding `saved` tensors cannot load into a model holding `expected`:
    names on one side only (when `strict`) and shapes that differ; None if it can."""
    problems = []
    shapes = [k for k in expected if k in saved and tuple(saved[k].shape) != tuple(expected[k].shape)]
    for key in shapes[:10]:
        problems.append(
            f"'{key}' has shape {tuple(saved[key].shape)} in the checkpoint but "
            f"{tuple(expected[key].shape)} in the model"
        )
    if strict:
        missing = [k for k in expected if k not in saved]
        unexpected = [k for k in saved if k not in expected]
        if missing:
            problems.append(f"{len(missing)} keys of the model are not in the checkpoint: {few(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} keys of the checkpoint are not in the model: {few(unexpected)}")
    if len(shapes) > 10:
        problems.append(f"and {len(shapes) - 10} more shape differences")
    if not problems:
        return None
    return (
        f"checkpoint {path} holds another model: "
        + "; ".join(problems)
        + ". Load a checkpoint of this model"
        + (", or set strict_loading=False" if strict else "")
        + "."
    )


# ---- optimizer state keyed by parameter name ------------------------------------------------
def _param_names(model: ShardedModel) -> dict[int, str]:
    """id(parameter object) -> its first name: shards (also after teardown, when the optimizer
    still holds them) and parameters the module registers whole."""
    names = {id(sp.param): sp.name for sp in model.sharded_params}
    for name, param in model.module.named_parameters():
        names.setdefault(id(param), name)
    return names


def optimizer_param_names(model: ShardedModel, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    names = _param_names(model)
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
    """Parameter name -> its number in `optimizer.state_dict()`, which numbers parameters 0, 1,
    ... in param_groups order; `groups` are the parameter names of each group."""
    return {name: i for i, name in enumerate(name for group in groups for name in group)}


def with_params(param_groups: Iterable[Mapping[str, Any]], params: Iterable[list[Any]]) -> list[dict[str, Any]]:
    """`param_groups` with each group's "params" replaced by the matching list of `params`
    (names for numbers, or numbers for names)."""
    return [{**group, "params": list(ps)} for group, ps in zip(param_groups, params)]


# ---- shards as DCP sees them ------------------------------------------------------------------
class Pieces:
    """Builds the DCP state dict of one rank: sharded tensors as DTensors over their unpadded
    local piece (Note: sharded checkpoint layout), the rest as plain tensors. With hierarchical
    sharding (shard groups replicated across the world) the mesh is 2-D, (replica, shard), and
    the placements (Replicate(), Shard(0)): DCP writes each chunk once."""

    def __init__(self, model: ShardedModel) -> None:
        self.model = model
        self._meshes: dict[str, Any] = {}

    def sharded(self, piece: torch.Tensor, numel: int) -> torch.Tensor:
        if not self.model.world_comm.distributed:
            return piece  # one process: the piece is the whole flat tensor
        from torch.distributed.tensor import DTensor, Replicate, Shard

        placements = [Shard(0)] if self.model.replicate_comm is None else [Replicate(), Shard(0)]
        mesh = self._mesh(piece.device.type)
        return DTensor.from_local(piece, mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))

    def _mesh(self, device_type: str) -> Any:
        if device_type not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            shard, replicate = self.model.comm, self.model.replicate_comm
            # Only built when distributed (`sharded`), where every Comm has its group.
            assert shard.group is not None
            if replicate is None:
                mesh = DeviceMesh.from_group(shard.group, device_type)
            else:
                assert replicate.group is not None
                layout = torch.arange(self.model.world_comm.world_size).reshape(replicate.world_size, shard.world_size)
                groups = [replicate.group, shard.group]
                mesh = DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=("replicate", "shard"))
            self._meshes[device_type] = mesh
        return self._meshes[device_type]


# ---- reading and validating a checkpoint directory ------------------------------------------
class ShardedCheckpoint:
    """A sharded checkpoint directory whose meta.json and DCP index have been read and checked.
    Unless `trusted`, nothing read from it runs code (Note: checkpoint trust model)."""

    def __init__(
        self, path: Path | RemotePath, meta: dict[str, Any], *, index: Any, saved: dict, trusted: bool
    ) -> None:
        self.path = path
        self.data = data_directory(path, meta)  # where its files are
        self.meta = meta
        self.index = index  # DCP's index (.metadata), read once
        self._saved = saved  # trainer_state.pt, read once
        self.trusted = trusted
        # state-dict key -> its meta.json entry, for lookups by name.
        self._entries: dict[str, dict[str, Any]] = {e["key"]: e for e in meta["state_dict"]}

    def kind(self, key: str) -> str | None:
        """How `key` was stored: "sharded", "tensor", "alias", "object", or None if absent."""
        entry = self._entries.get(key)
        return entry["kind"] if entry is not None else None

    def tensors(self) -> dict[str, TensorInfo]:
        """Full shape and dtype of every state-dict tensor, aliases included."""
        out = {}
        for key, entry in self._entries.items():
            source = self._entries[entry["of"]] if entry["kind"] == "alias" else entry
            if source["kind"] != "object":
                out[key] = TensorInfo(tuple(source["shape"]), source["dtype"])
        return out

    def stored_key(self, names: Iterable[str]) -> str | None:
        """The key under which a parameter known by `names` was stored (its first saved name)."""
        for name in names:
            entry = self._entries.get(name)
            if entry is not None:
                return entry["of"] if entry["kind"] == "alias" else name
        return None

    def reader(self) -> CheckpointReader:
        """A DCP storage reader of this directory that reuses the checked index."""
        return CheckpointReader(self.data, trusted=self.trusted, index=self.index)

    def trainer_state(self) -> dict[str, Any]:
        """trainer_state.pt (weights_only unless trusted): {"keys": the checkpoint dict's keys in
        order, "extra": its entries other than the state dict and optimizer states, "state_dict":
        non-tensor entries of the state dict, "optimizers": param_groups and non-tensor state}."""
        return dict(self._saved)

    def lightning_dict(self) -> dict[str, Any]:
        """The checkpoint dict Lightning saved, without reading a tensor: "state_dict" is a
        `ShardedStateDict` of meta tensors (full shapes) and "optimizer_states" a
        `ShardedOptimizerStates`; `load_sharded_model`/`load_sharded_optimizers` load them."""
        saved = self.trainer_state()
        state_dict = ShardedStateDict(self)
        for key, info in self.tensors().items():
            state_dict[key] = torch.empty(info.shape, dtype=dtype_of(info.dtype), device="meta")
        state_dict.update(saved["state_dict"])
        optimizer_states = None
        if self.meta["optimizers"] is not None:
            optimizer_states = ShardedOptimizerStates(self, saved["optimizers"])
        return in_saved_order(saved, state_dict, optimizer_states)


def in_saved_order(saved: dict[str, Any], state_dict: Any, optimizer_states: Any | None) -> dict[str, Any]:
    """The checkpoint dict from trainer_state.pt's entries and the given state dict and optimizer
    states, its keys in the order they were saved."""
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
    """Read and check a sharded checkpoint: meta.json, format version, every file's presence
    and size, the CRC-32 of the files this rank verifies (rank r checks files r, r + N, ...;
    all of them without `comm`), and DCP's index (Note: checkpoint trust model). With `comm`,
    ranks agree before returning (Note: no hang on a bad checkpoint)."""
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
        return ShardedCheckpoint(path, meta, index=index, saved=saved, trusted=trusted)

    result, error = error_of(check)
    agree(comm, error, context=f"Cannot load the checkpoint {path}")
    return result


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
        saved = [p.name for p in path.iterdir() if DATA_PREFIX.fullmatch(p.name) or p.match("__*_*.distcp")]
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
