"""What loading a checkpoint trusts: nothing in it runs code, and nothing in it points outside it.

[Note: checkpoint trust model]
A checkpoint is data from anywhere: by default loading runs no code from it (restricted
unpicklers, `weights_only=True`) and touches no file outside it (docs/design.md, checkpoint
trust model).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_zero3.checkpoint.errors import CheckpointError, describe_error
from lightning_zero3.checkpoint.remote import RemotePath
from lightning_zero3.engine import Comm

TRUST_HINT = (
    "If you trust where this checkpoint comes from, load it with ZeRO3Strategy(trust_checkpoint=True) "
    "(or lightning_zero3.load_checkpoint / load_from_checkpoint(..., trusted=True), or "
    "`python -m lightning_zero3 consolidate --trust-checkpoint`)"
)


def _not_plain(name: str) -> bool:
    return name in ("", ".", "..") or any(sep in name for sep in ("/", "\\", os.sep, os.altsep) if sep)


def check_plain_name(directory: Path | RemotePath, name: Any, source: str) -> None:
    """Raise unless `name` is a plain file name inside `directory`. A link is followed by reading
    it (never by stat'ing its target): only a link to a plain name in the directory is followed."""
    problem = None
    if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name:
        problem = f"{name!r} is not a file name"
    elif _not_plain(name):
        problem = f"{name!r} is not a plain file name inside the checkpoint directory"
    file, hops = directory / str(name), 0
    while problem is None and isinstance(file, Path) and file.is_symlink():  # an lstat inside the directory
        target = os.readlink(file)
        file, hops = directory / target, hops + 1
        if _not_plain(target):
            problem = f"{name!r} is a link to {target!r}, outside the checkpoint directory"
        elif hops > 40:
            problem = f"{name!r} is a loop of links"
    if problem is not None:
        raise CheckpointError(f"{source} is not a valid checkpoint: {problem}; it was not opened")


def check_meta(meta: dict[str, Any], meta_file: Path | RemotePath) -> None:
    """Raise `CheckpointError` naming `meta_file` unless every entry this package reads from
    meta.json has the type it must have (a hand-edited file fails here, not in a TypeError)."""

    def require(ok: bool, where: str, expected: str) -> None:
        if not ok:
            raise CheckpointError(f"{meta_file} is corrupted: {where} must be {expected}")

    def check_tensor(entry: Any, where: str, kinds: tuple[str, ...]) -> None:
        require(isinstance(entry, dict) and entry.get("kind") in kinds, where, f"an object with a 'kind' in {kinds}")
        if entry["kind"] in ("sharded", "tensor"):
            shape = entry.get("shape")
            sizes = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
            require(sizes, f"{where}['shape']", "a list of sizes")
            require(isinstance(entry.get("dtype"), str), f"{where}['dtype']", "a dtype name")

    require(type(meta["world_size"]) is int and meta["world_size"] >= 1, "'world_size'", "a positive integer")
    require(
        isinstance(meta["fingerprint"], str) and isinstance(meta["parameters"], dict),
        "'fingerprint' and 'parameters'",
        "a string and an object",
    )
    require(isinstance(meta["files"], dict), "'files'", "an object mapping file names to their size and CRC-32")
    for name, info in meta["files"].items():
        check_plain_name(meta_file.parent, name, str(meta_file))
        ok = isinstance(info, dict) and type(info.get("bytes")) is int and isinstance(info.get("crc32"), str)
        require(ok, f"'files'[{name!r}]", "an object with 'bytes' (an integer) and 'crc32' (a string)")
        require("rank" not in info or type(info["rank"]) is int, f"'files'[{name!r}]['rank']", "an integer")
    entries = meta["state_dict"]
    require(isinstance(entries, list), "'state_dict'", "a list")
    keys = {e.get("key") for e in entries if isinstance(e, dict)}
    for i, entry in enumerate(entries):
        check_tensor(entry, f"'state_dict'[{i}]", ("sharded", "tensor", "alias", "object"))
        require(isinstance(entry.get("key"), str), f"'state_dict'[{i}]['key']", "a string")
        ok = entry["kind"] != "alias" or entry.get("of") in keys
        require(ok, f"'state_dict'[{i}]['of']", "the key of another entry")
    require(meta["optimizers"] is None or isinstance(meta["optimizers"], list), "'optimizers'", "a list or null")
    for i, optimizer in enumerate(meta["optimizers"] or []):
        state = optimizer.get("state") if isinstance(optimizer, dict) else None
        ok = isinstance(state, dict) and all(isinstance(v, dict) for v in state.values())
        require(ok, f"'optimizers'[{i}]['state']", "an object of objects")
        assert state is not None
        for name, entry in state.items():
            for k, info in entry.items():
                check_tensor(info, f"'optimizers'[{i}]['state'][{name!r}][{k!r}]", ("sharded", "tensor"))


def _admitted() -> dict[tuple[str, str], Any]:
    """The globals DCP's index pickle refers to (found by recording every `find_class` while
    unpickling indexes torch 2.13 wrote). `_MEM_FORMAT_ENCODING` and `_StorageInfo` are private to
    torch, but its own pickle names them: a release that renames them makes loading refuse the
    index, naming the global."""
    classes = (
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        torch.Size,
        OrderedDict,
        dict,
        list,
        tuple,
        set,
        frozenset,
        str,
        bytes,
        int,
        float,
        bool,
        complex,
    )
    admitted: dict[tuple[str, str], Any] = {(cls.__module__, cls.__name__): cls for cls in classes}
    for path_cls in (PosixPath, WindowsPath, PurePosixPath, PureWindowsPath):  # StorageMeta.checkpoint_id
        admitted[("pathlib", path_cls.__name__)] = path_cls
    for module, name in (
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object
    ):
        obj = getattr(__import__(module, fromlist=[name]), name, None)
        if obj is not None:
            admitted[(module, name)] = obj
    return admitted


_ADMITTED = _admitted()
# BUILD may set only the fields of DCP's dataclasses, on their instances (a BUILD on a class would
# set class attributes for the rest of the process).
_FIELDS = {
    cls: frozenset(f.name for f in dataclasses.fields(cls))
    for cls in _ADMITTED.values()
    if isinstance(cls, type) and dataclasses.is_dataclass(cls)
}


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles only what a DCP index is made of (Python's unpickler: the C one has no hook for
    BUILD; an index is small)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, *, source: Path | RemotePath) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED:
            return _ADMITTED[(module, name)]
        value = getattr(torch, name, None) if module == "torch" and "." not in name else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise CheckpointError(
            f"{self.source} refers to the global '{module}.{name}', which a checkpoint's DCP index never needs; "
            f"it was not loaded, since unpickling it could run code. {TRUST_HINT}."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source} holds a persistent reference, which a DCP index never has")

    def load_build(self) -> None:
        inst, state = self.stack[-2], self.stack[-1]  # type: ignore[attr-defined]
        fields = _FIELDS.get(type(inst))
        own_setstate = fields is not None and "__setstate__" in vars(type(inst))  # TensorProperties: a tuple
        parts = state if isinstance(state, tuple) and len(state) == 2 and not own_setstate else (state,)
        # A non-dict state names no field: refused (a dict subclass, e.g. OrderedDict, names its keys).
        keys = [list(p) if isinstance(p, dict) else [p] for p in parts if p is not None]
        names = set() if own_setstate else {n for part in keys for n in part}
        if fields is None or not names <= fields:
            what = f"the class {inst.__name__}" if isinstance(inst, type) else f"a {type(inst).__name__}"
            raise CheckpointError(
                f"{self.source} sets the attributes {sorted(map(str, names)) or '(state)'} of {what}, which a DCP "
                f"index never does; it was not loaded"
            )
        super().load_build()  # type: ignore[misc]

    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]


def read_dcp_index(file: Path | RemotePath, *, trusted: bool) -> dcp_metadata.Metadata:
    """DCP's index at `file`, unpickled by `RestrictedUnpickler` unless `trusted`, and checked
    either way: a `Metadata` of tensors stored in plain-named files of its directory."""
    try:
        data = file.read_bytes()
        index = pickle.loads(data) if trusted else RestrictedUnpickler(io.BytesIO(data), source=file).load()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"cannot read {file}: {describe_error(err)}") from err
    if not isinstance(index, dcp_metadata.Metadata) or not isinstance(index.storage_data, dict):
        raise CheckpointError(f"{file} is not a DCP index: it holds a {type(index).__name__}")
    if not isinstance(index.state_dict_metadata, dict):
        raise CheckpointError(f"{file} is corrupted: it has no table of stored items")
    for key, item in index.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(
                f"{file} is not a lightning_zero3 checkpoint: it stores {key!r} as a {type(item).__name__}, and "
                f"a lightning_zero3 checkpoint stores only tensors"
            )
    for info in index.storage_data.values():
        check_plain_name(file.parent, getattr(info, "relative_path", None), str(file))
    return index


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file reader over `index`, which `read_dcp_index` read (DCP's `pickle.load` never runs)."""

    def __init__(self, path: Path | RemotePath, *, index: dcp_metadata.Metadata) -> None:
        super().__init__(path if not isinstance(path, RemotePath) else "")
        if isinstance(path, RemotePath):  # what DCP's FsspecReader sets (Note: remote checkpoints)
            from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

            self.fs = FileSystem()  # type: ignore[assignment]
            self.path = self.fs.init_path(str(path))
        self._index = index

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._index.storage_meta is None:
            self._index.storage_meta = dcp_metadata.StorageMeta()
        self._index.storage_meta.load_id = self.load_id
        return self._index

    def load(self, targets: dict[str, torch.Tensor], comm: Comm | None = None) -> None:
        """`dcp.load(targets)` from this directory (collective over `comm`); a failure is a `CheckpointError`."""
        distributed = comm is not None and comm.distributed
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                group = comm.group if comm is not None else None
                dcp.load(targets, storage_reader=self, process_group=group, no_dist=not distributed)
        except (Exception, dcp.CheckpointException) as err:
            raise CheckpointError(f"Loading {self.path} failed: {describe_error(err)}") from err


def load_torch_file(file: Path | RemotePath, *, trusted: bool, mmap: bool = False) -> Any:
    """`torch.load` of a checkpoint's file, weights_only unless `trusted`; `mmap` (a local zip
    file) lets the ranks of one machine share the page cache."""
    try:
        if mmap and isinstance(file, Path):
            try:
                return torch.load(file, map_location="cpu", mmap=True, weights_only=not trusted)
            except RuntimeError as err:
                if "mmap can only be used" not in str(err):
                    raise  # else a legacy (non-zip) file: read it as a stream
        with file.open("rb") as f:
            return torch.load(f, map_location="cpu", weights_only=not trusted)
    except Exception as err:
        forbidden = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(err))
        if forbidden is not None:
            raise CheckpointError(
                f"{file} refers to the global '{forbidden.group(1)}', which torch.load(weights_only=True) does not "
                f"admit; it was not loaded, since unpickling it could run code. {TRUST_HINT}."
            ) from err
        with file.open("rb") as f:
            if f.read(4) == b"PK\x03\x04":  # torch.save's files are zip archives
                raise CheckpointError(
                    f"{file} is truncated or damaged: it begins as a torch.save archive but torch cannot read it "
                    f"({describe_error(err)}); save it again, or restore it from a copy"
                ) from err
        raise CheckpointError(f"{file} is not a checkpoint torch can read: {describe_error(err)}") from err


def check_trainer_state(saved: Any, file: Path | RemotePath) -> Mapping[str, Any]:
    needed = ("keys", "extra", "state_dict", "optimizers")
    if not isinstance(saved, dict) or not all(k in saved for k in needed):
        raise CheckpointError(f"{file} is corrupted: it is not the dict of {needed} that a save writes")
    return saved
