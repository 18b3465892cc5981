"""Sharded checkpoints: saved by every rank without gathering, validated before any collective,
loaded at any world size, and replaced on disk atomically. Framework-independent: the Lightning
checkpoint dict is only a dict here.

[Note: sharded checkpoint layout]
A sharded checkpoint is a directory (the path the user gave, e.g. ``epoch=3-step=400.ckpt``):

    meta.json          written last, its presence marks a complete checkpoint: format and
                       version, world size, every tensor's full shape and dtype, a fingerprint of
                       the model's parameter names and shapes, and each file's size and CRC-32
    trainer_state.pt   ``torch.save`` of everything that is not a tensor: the rest of Lightning's
                       checkpoint dict (epoch, loops, LR schedulers, callbacks, hyper-parameters),
                       optimizer param_groups (parameters by name), non-tensor optimizer state
    .metadata          torch.distributed.checkpoint (DCP) index: which file holds which chunk
    __<r>_0.distcp     rank r's chunks: its piece of every sharded parameter and optimizer state

DCP keys: ``state_dict/<name>`` for the module's state dict (a tied parameter once, under its first
name; the other names are aliases in meta.json) and ``optimizer_states/<i>/<name>/<key>`` for
optimizer state, parameters named by their first name. A sharded tensor is stored flattened, as a
1-D DTensor with placement Shard(0): ``torch.chunk`` gives rank r elements
[r * ceil(n/N), min((r + 1) * ceil(n/N), n)), exactly the unpadded part of our shard (Note: shard
layout in engine/shard.py), and DCP records each chunk's global offset. Loading at another world
size asks DCP for the new slice of the flat tensor; DCP reads the overlapping chunks. Replicated
tensors (buffers, persistent parameters, optimizer steps) are plain tensors, written once.

[Note: no hang on a bad checkpoint]
Every step that can fail on some ranks only (reading files, checksums, a full disk) is followed by
`_agree`: one all_gather_object of each rank's error (or None); then every rank raises the same
`CheckpointError` or every rank goes on. Collectives on data (DCP's own) only run after that.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.model import ShardedModel
from lightning_zero3.engine.shard import ShardedParam

FORMAT = "lightning_zero3.sharded"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.pt"
DCP_INDEX_FILE = ".metadata"
_PARTIAL_SUFFIX = ".zero3-partial"
_TRASH_SUFFIX = ".zero3-trash"
_CHUNK = 1 << 20  # bytes read at a time for checksums
_TENSOR_KEYS = ("state_dict", "optimizer_states")  # the entries of a checkpoint dict stored by DCP


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, read or loaded; the message names the path and the problem."""


# ---- agreement between ranks (Note: no hang on a bad checkpoint) ----------------------------
def _agree(comm: Comm | None, error: str | None, *, context: str | None) -> None:
    """Raise the same `CheckpointError` on every rank if any rank reports an error. Without
    `comm` (one process) the error is raised as it is; with it, prefixed by `context`."""
    errors = comm.all_gather_object(error) if comm is not None else [error]
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if len(errors) == 1:
        detail = failed[0][1]
    elif len({e for _, e in failed}) == 1:
        detail = f"{failed[0][1]} (on rank {', '.join(str(r) for r, _ in failed)})"
    else:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
    raise CheckpointError(f"{context}: {detail}" if context is not None and comm is not None else detail)


def _error_of(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run `fn`; return (result, None) or (None, message) so the error can be agreed on."""
    try:
        return fn(), None
    except Exception as err:  # noqa: BLE001 - reported to every rank by `_agree`
        return None, _describe(err)


def _describe(err: BaseException) -> str:
    if isinstance(err, CheckpointError):
        return str(err)
    if isinstance(err, dcp.CheckpointException):  # DCP's agreed failure: each rank's exception
        return "; ".join(f"rank {rank}: {_describe(exc)}" for rank, (exc, _) in sorted(err.failures.items()))
    return f"{type(err).__name__}: {err}"


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


def _sharded_by_name(model: ShardedModel) -> dict[str, ShardedParam]:
    return {name: sp for sp in model.sharded_params for name in sp.names}


def model_tensors(model: ShardedModel) -> dict[str, TensorInfo]:
    """Full shape and dtype of every tensor in the module's state dict, sharded or not."""
    sharded = _sharded_by_name(model)
    out = {}
    for key, value in model.module.state_dict().items():
        if key in sharded:
            sp = sharded[key]
            out[key] = TensorInfo(tuple(sp.full_shape), dtype_name(sp.param.dtype))
        elif isinstance(value, torch.Tensor):
            out[key] = TensorInfo(tuple(value.shape), dtype_name(value.dtype))
    return out


def model_parameter_shapes(model: ShardedModel) -> dict[str, tuple[int, ...]]:
    shapes = {name: tuple(sp.full_shape) for sp in model.sharded_params for name in sp.names}
    for name, param in model.module.named_parameters(remove_duplicate=False):
        shapes.setdefault(name, tuple(param.shape))
    return shapes


def model_parameters(model: ShardedModel) -> dict[str, dict[str, Any]]:
    """Every parameter name (tied ones under each name) with its full shape and dtype."""
    dtypes = {name: sp.param.dtype for sp in model.sharded_params for name in sp.names}
    dtypes.update({n: p.dtype for n, p in model.module.named_parameters(remove_duplicate=False) if n not in dtypes})
    shapes = model_parameter_shapes(model)
    return {name: {"shape": list(shape), "dtype": dtype_name(dtypes[name])} for name, shape in shapes.items()}


def fingerprint(parameter_shapes: Mapping[str, Iterable[int]]) -> str:
    """A hash of the parameter names and full shapes: equal for checkpoints of the same model."""
    text = "\n".join(f"{name}:{tuple(shape)}" for name, shape in sorted(parameter_shapes.items()))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def describe_mismatch(
    path: str | os.PathLike, saved: Mapping[str, TensorInfo], expected: Mapping[str, TensorInfo], *, strict: bool
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
            problems.append(f"{len(missing)} keys of the model are not in the checkpoint: {_few(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} keys of the checkpoint are not in the model: {_few(unexpected)}")
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


def _few(names: list[str], n: int = 8) -> str:
    shown = ", ".join(f"'{k}'" for k in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


# ---- optimizer state keyed by parameter name ------------------------------------------------
def _param_names(model: ShardedModel) -> dict[int, str]:
    """id(parameter object) -> its first name: shards (also after teardown, when the optimizer
    still holds them) and parameters the module registers whole."""
    names = {id(sp.param): sp.name for sp in model.sharded_params}
    for name, param in model.module.named_parameters():
        names.setdefault(id(param), name)
    return names


def _optimizer_param_names(model: ShardedModel, optimizer: torch.optim.Optimizer) -> list[list[str]]:
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


def sharded_optimizer_state(model: ShardedModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with parameters named instead of numbered; shard-shaped state
    stays this rank's shard. No collective."""
    packed = optimizer.state_dict()
    groups = _optimizer_param_names(model, optimizer)
    order = [name for group in groups for name in group]
    state = {order[index]: dict(entry) for index, entry in packed["state"].items()}
    param_groups = [{**group, "params": names} for group, names in zip(packed["param_groups"], groups)]
    return {"state": state, "param_groups": param_groups}


def _is_shard_state(value: Any, sp: ShardedParam) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == sp.shard_numel


# ---- saving ---------------------------------------------------------------------------------
class _Pieces:
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
            if replicate is None:
                mesh = DeviceMesh.from_group(shard.group, device_type)
            else:
                layout = torch.arange(self.model.world_comm.world_size).reshape(replicate.world_size, shard.world_size)
                groups = [replicate.group, shard.group]
                mesh = DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=("replicate", "shard"))
            self._meshes[device_type] = mesh
        return self._meshes[device_type]


def _local_piece(sp: ShardedParam, value: torch.Tensor, *, whole: bool, key: str) -> torch.Tensor:
    """This rank's unpadded piece of `value` (a shard, or the whole tensor after teardown)."""
    start, valid = sp.rank * sp.shard_numel, sp.valid_numel()
    if whole:
        if value.numel() != sp.numel:
            raise CheckpointError(f"'{key}' has {value.numel()} elements but the parameter has {sp.numel}")
        return value.detach().reshape(-1)[start : start + valid]
    if value.numel() != sp.shard_numel:
        raise CheckpointError(f"'{key}' has {value.numel()} elements but this rank's shard has {sp.shard_numel}")
    return value.detach().reshape(-1)[:valid]


def _plan_save(
    model: ShardedModel,
    state_dict: Mapping[str, Any],
    optimizer_states: list[Mapping[str, Any]] | None,
    *,
    whole: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(tensors for DCP, objects for trainer_state.pt, tensor inventory for meta.json)."""
    pieces = _Pieces(model)
    sharded = _sharded_by_name(model)
    tensors: dict[str, torch.Tensor] = {}
    entries: list[dict[str, Any]] = []
    state_objects: dict[str, Any] = {}
    for key, value in state_dict.items():
        sp = sharded.get(key)
        if not isinstance(value, torch.Tensor):
            state_objects[key] = value
            entries.append({"key": key, "kind": "object"})
        elif sp is not None and key != sp.name:
            entries.append({"key": key, "kind": "alias", "of": sp.name})
        elif sp is not None:
            piece = _local_piece(sp, value, whole=whole, key=key)
            tensors[f"state_dict/{key}"] = pieces.sharded(piece, sp.numel)
            info = TensorInfo(tuple(sp.full_shape), dtype_name(value.dtype))
            entries.append({"key": key, "kind": "sharded", **info.as_json()})
        else:
            tensors[f"state_dict/{key}"] = value.detach()
            info = TensorInfo(tuple(value.shape), dtype_name(value.dtype))
            entries.append({"key": key, "kind": "tensor", **info.as_json()})
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
                dcp_key = f"optimizer_states/{index}/{name}/{k}"
                if sp is not None and _is_shard_state(v, sp):
                    tensors[dcp_key] = pieces.sharded(v.detach()[: sp.valid_numel()], sp.numel)
                    info = TensorInfo(tuple(sp.full_shape), dtype_name(v.dtype))
                    state_meta.setdefault(name, {})[k] = {"kind": "sharded", **info.as_json()}
                else:
                    tensors[dcp_key] = v.detach()
                    info = TensorInfo(tuple(v.shape), dtype_name(v.dtype))
                    state_meta.setdefault(name, {})[k] = {"kind": "tensor", **info.as_json()}
        optimizers_meta.append({"state": state_meta})
        optimizers_objects.append({"param_groups": optim_state["param_groups"], "state": state_objs})
    meta = {"state_dict": entries, "optimizers": optimizers_meta if optimizer_states is not None else None}
    objects = {"state_dict": state_objects, "optimizers": optimizers_objects}
    return tensors, objects, meta


def save_sharded(
    path: str | os.PathLike, model: ShardedModel, checkpoint: Mapping[str, Any], *, whole: bool = False
) -> None:
    """Write `checkpoint` as a sharded checkpoint directory at `path`; every rank calls it with
    the same path.

    `checkpoint["state_dict"]` is the module's state dict on this rank (shards, or whole tensors
    if `whole`), `checkpoint["optimizer_states"]` (optional: a weights-only checkpoint has none)
    a list of `sharded_optimizer_state`s; every other entry is kept as it is (Lightning's epoch,
    loops, ...). The directory is written under a temporary name and renamed to `path` only once
    every rank's part is on disk; on any failure the previous checkpoint at `path` is left as it
    was and every rank raises `CheckpointError`."""
    state_dict, optimizer_states = checkpoint["state_dict"], checkpoint.get("optimizer_states")
    extra = {"keys": list(checkpoint), "extra": {k: v for k, v in checkpoint.items() if k not in _TENSOR_KEYS}}
    path = Path(path)
    comm = model.world_comm
    partial = _sibling(path, _PARTIAL_SUFFIX)
    context = f"Saving the checkpoint {path} failed (any previous checkpoint there is unchanged)"
    try:
        _, error = _error_of(lambda: _fresh_directory(partial) if comm.rank == 0 else None)
        _agree(comm, error, context=context)
        planned, error = _error_of(lambda: _plan_save(model, state_dict, optimizer_states, whole=whole))
        _agree(comm, error, context=context)
        tensors, objects, inventory = planned
        writer = dcp.FileSystemWriter(partial, single_file_per_rank=True, sync_files=True, thread_count=1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(tensors, storage_writer=writer, process_group=comm.group, no_dist=not comm.distributed)
        except (Exception, dcp.CheckpointException) as err:
            raise CheckpointError(f"{context}: writing the shards failed: {_describe(err)}") from err
        mine, error = _error_of(lambda: _checksums(partial, _rank_files(partial, comm.rank)))
        _agree(comm, error, context=context)
        every = comm.all_gather_object(mine)
        if comm.rank == 0:
            files = {name: info for part in every for name, info in part.items()}
            _, error = _error_of(lambda: _finish(path, partial, files, objects, inventory, model, extra, comm))
        else:
            error = None
        _agree(comm, error, context=context)
    except BaseException:
        if comm.rank == 0:
            _remove_path(partial)
        raise


def _finish(
    path: Path,
    partial: Path,
    files: dict[str, dict[str, Any]],
    objects: dict[str, Any],
    inventory: dict[str, Any],
    model: ShardedModel,
    extra: dict[str, Any],
    comm: Comm,
) -> None:
    """Rank 0, once every rank's shards are on disk: the pickled remainder, then meta.json,
    then the atomic swap into `path`."""
    indexed = {info.relative_path for info in dcp.FileSystemReader(partial).read_metadata().storage_data.values()}
    missing = sorted(indexed - set(files))
    if missing:
        raise CheckpointError(f"the DCP index names files no rank reported: {missing}")
    _fsynced_torch_save({**extra, **objects}, partial / TRAINER_STATE_FILE)
    files.update(_checksums(partial, [DCP_INDEX_FILE, TRAINER_STATE_FILE]))
    lightning = extra["extra"]
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "shard_size": model.comm.world_size,
        "torch_version": torch.__version__,
        "fingerprint": fingerprint(model_parameter_shapes(model)),
        "parameters": model_parameters(model),
        "lightning": {k: lightning[k] for k in ("epoch", "global_step", "pytorch-lightning_version") if k in lightning},
        **inventory,
        "files": files,
    }
    _write_json_atomically(meta, partial / META_FILE)
    _fsync_directory(partial)
    replace_path(partial, path)


def _rank_files(directory: Path, rank: int) -> list[str]:
    return sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))


def _dcp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("__*_*.distcp"))


# ---- reading and validating -----------------------------------------------------------------
class ShardedCheckpoint:
    """A sharded checkpoint directory whose meta.json has been read and checked."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        # state-dict key -> its meta.json entry, for lookups by name.
        self._entries: dict[str, dict[str, Any]] = {e["key"]: e for e in meta["state_dict"]}

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    def entries(self) -> list[dict[str, Any]]:
        return list(self.meta["state_dict"])

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

    def trainer_state(self, *, weights_only: bool | None = None) -> dict[str, Any]:
        """trainer_state.pt: {"keys": the checkpoint dict's keys in order, "extra": its entries
        other than the state dict and optimizer states, "state_dict": non-tensor entries of the
        state dict, "optimizers": param_groups and non-tensor state}."""
        file = self.path / TRAINER_STATE_FILE
        try:
            return torch.load(file, map_location="cpu", weights_only=bool(weights_only))
        except Exception as err:
            raise CheckpointError(f"cannot read {file}: {_describe(err)}") from err

    def lightning_dict(self, *, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict Lightning saved, without reading a tensor: "state_dict" is a
        `ShardedStateDict` of meta tensors (full shapes) and "optimizer_states" a
        `ShardedOptimizerStates`; `load_sharded_model`/`load_sharded_optimizers` load them."""
        saved = self.trainer_state(weights_only=weights_only)
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


def run_and_agree(comm: Comm | None, fn: Callable[[], Any], *, context: str) -> Any:
    """Run `fn` on every rank, then agree (Note: no hang on a bad checkpoint): every rank
    returns its result, or every rank raises `CheckpointError` naming `context`."""
    result, error = _error_of(fn)
    _agree(comm, error, context=context)
    return result


def load_full_file(path: str | os.PathLike, *, weights_only: bool | None = None) -> dict[str, Any]:
    """A full (single-file) checkpoint, memory-mapped where the file allows it, so that every
    rank reading it shares the page cache rather than holding its own copy."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory: open it with `open_sharded`")
    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except RuntimeError as err:
            if "zipfile" not in str(err) and "mmap" not in str(err):
                raise
            checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as err:
        raise CheckpointError(f"{path} is not a checkpoint torch can read: {_describe(err)}") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        tensors_only = isinstance(checkpoint, dict) and all(isinstance(v, torch.Tensor) for v in checkpoint.values())
        if checkpoint and tensors_only:
            raise CheckpointError(
                f"{path} is a plain state dict, not a Lightning checkpoint: to fine-tune from it, load it into the "
                f"model before fit (`model.load_state_dict(torch.load(path))`)"
            )
        raise CheckpointError(f"{path} is not a Lightning checkpoint: it has no 'state_dict'")
    return checkpoint


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path, META_FILE).is_file()


def open_sharded(
    path: str | os.PathLike,
    *,
    comm: Comm | None = None,
    verify: bool = True,
    files_to_verify: Callable[[list[str]], list[str]] | None = None,
) -> ShardedCheckpoint:
    """Read and check a sharded checkpoint: meta.json, format version, every file's presence
    and size, and the CRC-32 of the files this rank verifies (rank r checks files r, r + N,
    ...; all of them without `comm`). With `comm`, ranks agree before returning (Note: no hang
    on a bad checkpoint)."""
    path = Path(path)
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)

    def check() -> ShardedCheckpoint:
        meta = _read_meta(path)
        names = sorted(meta["files"])
        for name in names:
            _check_file(path, name, meta["files"][name], crc=False)
        if verify:
            chosen = files_to_verify(names) if files_to_verify is not None else names[rank::world]
            for name in chosen:
                _check_file(path, name, meta["files"][name], crc=True)
        return ShardedCheckpoint(path, meta)

    result, error = _error_of(check)
    _agree(comm, error, context=f"Cannot load the checkpoint {path}")
    return result


def _read_meta(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint directory")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        if (path / DCP_INDEX_FILE).exists() or _dcp_files(path):
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
    return meta


def _check_file(directory: Path, name: str, expected: Mapping[str, Any], *, crc: bool) -> None:
    file = directory / name
    what = f"rank {expected['rank']}'s shard file" if "rank" in expected else "file"
    if not file.is_file():
        raise CheckpointError(f"{what} {file} is missing")
    size = file.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{what} {file} is truncated or damaged: {size} bytes, expected {expected['bytes']}")
    if crc:
        actual = _crc32(file)
        if actual != expected["crc32"]:
            raise CheckpointError(
                f"{what} {file} is corrupted: CRC-32 {actual} does not match {expected['crc32']} in {META_FILE}"
            )


def _crc32(file: Path) -> str:
    value = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def _checksums(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        file = directory / name
        info: dict[str, Any] = {"bytes": file.stat().st_size, "crc32": _crc32(file)}
        if name.startswith("__") and name.endswith(".distcp"):
            info["rank"] = int(name[2:].split("_", 1)[0])
        out[name] = info
    return out


# ---- loading into a live model --------------------------------------------------------------
def check_loadable(ckpt: ShardedCheckpoint, model: ShardedModel, *, strict: bool) -> str | None:
    """Why `ckpt` cannot load into `model` (names or shapes), or None."""
    return describe_mismatch(ckpt.path, ckpt.tensors(), model_tensors(model), strict=strict)


def check_state_dict_loadable(
    path: str | os.PathLike, state_dict: Mapping[str, Any], model: ShardedModel, *, strict: bool
) -> str | None:
    """Why a full state dict (whole tensors) read from `path` cannot load into `model`, or None."""
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    saved = {k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in tensors.items()}
    return describe_mismatch(path, saved, model_tensors(model), strict=strict)


def load_sharded_model(ckpt: ShardedCheckpoint, model: ShardedModel) -> None:
    """Load the module's state dict from `ckpt` in place, at this run's world size: each rank
    reads only the chunks that overlap its new shards. Collective: check first (`open_sharded`,
    `check_loadable`) so that every rank gets here. Tensors of the model that the checkpoint
    lacks (allowed by strict=False) keep their values."""
    loads = _Loads(model, ckpt)
    sharded = _sharded_by_name(model)
    with torch.no_grad():
        for sp in model.sharded_params:
            key = ckpt.stored_key(sp.names)
            if key is not None:
                loads.into_shard(f"state_dict/{key}", ckpt.kind(key), sp, sp.param.data)
        for key, value in model.module.state_dict().items():
            if key not in sharded and isinstance(value, torch.Tensor) and ckpt.kind(key) in ("tensor", "sharded"):
                loads.into_whole(f"state_dict/{key}", ckpt.kind(key), value)  # a view of the module's tensor
        loads.run()
        objects = [e["key"] for e in ckpt.entries() if e["kind"] == "object"]
        if objects:
            saved = ckpt.trainer_state()["state_dict"]
            model.module.load_state_dict({k: saved[k] for k in objects}, strict=False)


class _Loads:
    """The tensors one DCP load fills, and the copies to make after it when a parameter is
    sharded in this run but was whole in the saved one (or the reverse: a different
    persistence_threshold)."""

    def __init__(self, model: ShardedModel, ckpt: ShardedCheckpoint) -> None:
        self.model = model
        self.ckpt = ckpt
        self.pieces = _Pieces(model)
        self.targets: dict[str, torch.Tensor] = {}
        self.after: list[Callable[[], None]] = []

    def into_shard(self, key: str, kind: str, sp: ShardedParam, shard: torch.Tensor) -> None:
        """Fill this rank's `shard` (padded, 1-D) of parameter `sp` from `key`."""
        if kind == "sharded":
            self.targets[key] = self.pieces.sharded(shard[: sp.valid_numel()], sp.numel)
            return
        full = self.targets[key] = torch.empty(sp.full_shape, dtype=shard.dtype)
        start, valid = sp.rank * sp.shard_numel, sp.valid_numel()
        self.after.append(lambda: shard[:valid].copy_(full.reshape(-1)[start : start + valid]))

    def into_whole(self, key: str, kind: str, tensor: torch.Tensor) -> None:
        """Fill a tensor every rank holds whole (a buffer, a persistent parameter)."""
        self.targets[key] = tensor.reshape(-1) if kind == "sharded" else tensor

    def run(self) -> None:
        _dcp_load(self.targets, self.ckpt, self.model.world_comm)
        for copy in self.after:
            copy()


def load_sharded_optimizers(
    ckpt: ShardedCheckpoint, model: ShardedModel, optimizers: list[torch.optim.Optimizer]
) -> None:
    """Load optimizer state from `ckpt`, each rank keeping its slice of the sharded state for
    this run's world size. Parameters are matched by name, so the optimizers must have the
    same param groups (by name) as the ones saved."""
    by_name = _sharded_by_name(model)
    whole_params = dict(model.module.named_parameters(remove_duplicate=False))

    def plan() -> tuple[_Loads, list[dict[str, Any]]]:
        saved_meta = ckpt.meta["optimizers"]
        if saved_meta is None:
            raise CheckpointError(f"checkpoint {ckpt.path} was saved with weights only: it has no optimizer state")
        saved_objects = ckpt.trainer_state()["optimizers"]
        if len(saved_meta) != len(optimizers):
            raise CheckpointError(
                f"checkpoint {ckpt.path} has state for {len(saved_meta)} optimizers but this run configured "
                f"{len(optimizers)}"
            )
        loads = _Loads(model, ckpt)
        packed_all = []
        for index, (optimizer, meta, objs) in enumerate(zip(optimizers, saved_meta, saved_objects)):
            groups = _optimizer_param_names(model, optimizer)
            _check_groups(ckpt.path, index, [g["params"] for g in objs["param_groups"]], groups)
            order = {name: i for i, name in enumerate(name for group in groups for name in group)}
            state: dict[int, dict[str, Any]] = {}
            for name in set(meta["state"]) | set(objs["state"]):
                entry = state.setdefault(order[name], dict(objs["state"].get(name, {})))
                for k, info in meta["state"].get(name, {}).items():
                    key, dtype = f"optimizer_states/{index}/{name}/{k}", dtype_of(info["dtype"])
                    sp = by_name.get(name)
                    # Shard-shaped in this run: saved sharded, or saved whole with the parameter's shape.
                    shard_now = sp is not None and (
                        info["kind"] == "sharded" or tuple(info["shape"]) == tuple(sp.full_shape)
                    )
                    if shard_now:
                        entry[k] = torch.zeros(sp.shard_numel, dtype=dtype, device=sp.param.device)
                        loads.into_shard(key, info["kind"], sp, entry[k])
                    elif info["kind"] == "sharded":  # a parameter this run keeps whole
                        entry[k] = torch.empty(whole_params[name].shape, dtype=dtype)
                        loads.into_whole(key, "sharded", entry[k])
                    else:
                        entry[k] = torch.empty(info["shape"], dtype=dtype)
                        loads.into_whole(key, "tensor", entry[k])
            param_groups = [
                {**saved_group, "params": [order[n] for n in names]}
                for saved_group, names in zip(objs["param_groups"], groups)
            ]
            packed_all.append({"state": state, "param_groups": param_groups})
        return loads, packed_all

    planned, error = _error_of(plan)
    _agree(model.world_comm, error, context=f"Cannot load the optimizer state of {ckpt.path}")
    loads, packed_all = planned
    loads.run()
    for optimizer, packed in zip(optimizers, packed_all):
        optimizer.load_state_dict(packed)


def _check_groups(path: Path, index: int, saved: list[list[str]], current: list[list[str]]) -> None:
    if len(saved) != len(current):
        raise CheckpointError(
            f"checkpoint {path}: optimizer {index} had {len(saved)} param groups, this run's has {len(current)}"
        )
    for g, (old, new) in enumerate(zip(saved, current)):
        if set(old) != set(new):
            gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
            raise CheckpointError(
                f"checkpoint {path}: param group {g} of optimizer {index} differs: only in the checkpoint "
                f"{_few(gone)}; only in this run {_few(added)}"
            )


def _dcp_load(targets: dict[str, torch.Tensor], ckpt: ShardedCheckpoint, comm: Comm) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                targets,
                storage_reader=dcp.FileSystemReader(ckpt.path),
                process_group=comm.group,
                no_dist=not comm.distributed,
            )
    except (Exception, dcp.CheckpointException) as err:
        raise CheckpointError(f"Loading {ckpt.path} failed: {_describe(err)}") from err


def load_sharded(
    path: str | os.PathLike,
    model: ShardedModel,
    *,
    optimizers: list[torch.optim.Optimizer] | tuple = (),
    strict: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Check and load a sharded checkpoint into `model` (and `optimizers`) at this run's world
    size; return the other entries of the checkpoint dict it was saved from. Every rank calls it."""
    ckpt = open_sharded(path, comm=model.world_comm, verify=verify)
    problem = check_loadable(ckpt, model, strict=strict)
    _agree(model.world_comm, problem, context=f"Cannot load the checkpoint {path}")
    load_sharded_model(ckpt, model)
    if optimizers:
        load_sharded_optimizers(ckpt, model, list(optimizers))
    return dict(ckpt.trainer_state()["extra"])


# ---- files: atomic replace and remove -------------------------------------------------------
def _sibling(path: Path, suffix: str) -> Path:
    """A hidden name next to `path` (same directory, hence same filesystem for renames)."""
    return path.with_name(f".{path.name}{suffix}")


def _fresh_directory(path: Path) -> None:
    _remove_path(path)
    path.mkdir(parents=True)


def _fsync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomically(obj: dict[str, Any], file: Path) -> None:
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(_json_one_entry_per_line(obj))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


def _json_one_entry_per_line(obj: dict[str, Any]) -> str:
    """JSON with each top-level key on a line, and each entry of a top-level table on its own."""
    lines = []
    for key, value in obj.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            inner = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f" {json.dumps(key)}: {{\n{inner}\n }}")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            inner = ",\n".join(f"  {json.dumps(v)}" for v in value)
            lines.append(f" {json.dumps(key)}: [\n{inner}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _fsynced_torch_save(obj: Any, file: Path) -> None:
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save(obj, path)` that never leaves a partial file at `path`: written under a
    temporary name, synced, then swapped in (replacing a file or a sharded directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = _sibling(path, _PARTIAL_SUFFIX)
    _remove_path(partial)
    try:
        _fsynced_torch_save(obj, partial)
        replace_path(partial, path)
    except BaseException:
        _remove_path(partial)
        raise


def replace_path(new: Path, path: Path) -> None:
    """Move `new` (a file or directory) to `path`, replacing whatever is there. Atomic where
    the kernel can exchange two names (Linux renameat2); otherwise the old one is moved aside
    first, so a crash leaves either the old or the new checkpoint, never a mix."""
    if os.path.lexists(path) and not (path.is_file() and new.is_file() and not path.is_symlink()):
        if _exchange(new, path):
            _remove_path(new)  # now the old one
            _fsync_directory(path.parent)
            return
        trash = _sibling(path, _TRASH_SUFFIX)
        _remove_path(trash)
        os.rename(path, trash)
        os.rename(new, path)
        _remove_path(trash)
    else:
        os.replace(new, path)  # atomic for a file over a file, or onto a free name
    _fsync_directory(path.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _remove_path(path: Path) -> None:
    """Remove a file, link or checkpoint directory; meta.json first, so that a removal cut
    short never leaves something that looks like a complete checkpoint."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        (path / META_FILE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Remove a checkpoint (a file, a link to one, or a sharded directory). A directory is first
    renamed to a hidden name, so it disappears from `path` at once."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        trash = _sibling(path, _TRASH_SUFFIX)
        _remove_path(trash)
        os.rename(path, trash)
        _remove_path(trash)
    else:
        _remove_path(path)


__all__ = [
    "CheckpointError",
    "check_loadable",
    "check_state_dict_loadable",
    "ShardedCheckpoint",
    "ShardedOptimizerStates",
    "ShardedStateDict",
    "atomic_torch_save",
    "describe_mismatch",
    "fingerprint",
    "in_saved_order",
    "is_sharded_checkpoint",
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
