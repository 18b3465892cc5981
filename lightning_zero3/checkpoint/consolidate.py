"""Consolidation: one ordinary checkpoint file from a sharded checkpoint directory, offline (no
process group, none of the ranks that wrote it), one tensor at a time.

[Note: streaming consolidation]
The output is written as it is read: the file's structure (everything but tensor bytes) goes
first, then each tensor is read from the shards (DCP reads only the chunks of that tensor),
written, and freed before the next. Peak memory is about one tensor plus one saved chunk,
whatever the size of the output. For a Lightning/torch file this needs the records of
`torch.save`'s zip format written in that order: `_stream_torch_save` is `torch.save` whose
tensors may be `_Deferred`, produced when their record is written. Safetensors is simpler: its
header lists every tensor's offset, known from the shapes before any byte is read.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import struct
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, SupportsIndex

import torch
import torch.distributed.checkpoint as dcp

from lightning_zero3.checkpoint.errors import CheckpointError, describe_error
from lightning_zero3.checkpoint.files import (
    PARTIAL_SUFFIX,
    check_replaceable,
    fsync_file,
    remove_path,
    replace_path,
    sibling,
)
from lightning_zero3.checkpoint.format import ShardedCheckpoint, dcp_no_dist, dtype_of, in_saved_order, open_sharded
from lightning_zero3.checkpoint.trust import CheckpointReader

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp64": torch.float64, "float64": torch.float64,
}  # fmt: skip


@dataclass
class Progress:
    """Tensors and bytes written so far, of the totals; passed to the `progress` callback."""

    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class ConsolidationSummary:
    src: Path
    dst: Path
    world_size: int
    tensors: int
    bytes: int
    file_bytes: int
    seconds: float

    def line(self) -> str:
        return (
            f"Consolidated {self.src} ({self.world_size} ranks) into {self.dst}: {self.tensors} tensors, "
            f"{_mb(self.bytes)} of tensor data, {_mb(self.file_bytes)} on disk, in {self.seconds:.1f} s"
        )


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ---- tensors produced on demand -------------------------------------------------------------
class _Deferred:
    """A tensor of known shape and dtype whose data `produce()` returns when it is written."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, produce: Callable[[], torch.Tensor]) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.produce = produce

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def materialize(self) -> torch.Tensor:
        tensor = self.produce().to(self.dtype).reshape(self.shape).contiguous()
        if tensor.untyped_storage().nbytes() != self.nbytes:
            tensor = tensor.clone()  # a view of a bigger storage: write only this tensor's bytes
        return tensor

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # Pickled as torch pickles a contiguous CPU tensor; the storage is a persistent id.
        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        return torch._utils._rebuild_tensor_v2, (_DeferredStorage(self), 0, self.shape, stride, False, OrderedDict())


class _DeferredStorage:
    def __init__(self, tensor: _Deferred) -> None:
        self.tensor = tensor


def _stream_torch_save(obj: Any, file: Path, on_tensor: Callable[[int], None]) -> None:
    """`torch.save(obj, file)` where `obj` may hold `_Deferred` tensors: the same zip records in
    the same order as torch.serialization._save (pickle, then one record per storage), each
    deferred storage produced, written and dropped in turn. Readable by plain `torch.load`
    (also with weights_only=True and mmap=True)."""
    from torch.serialization import get_crc32_options, location_tag, normalize_storage_type
    from torch.utils.serialization import config

    records: dict[str, Any] = {}  # storage key -> torch storage or _Deferred, in pickling order
    keys: dict[int, str] = {}

    def persistent_id(o: Any) -> Any:
        if isinstance(o, _DeferredStorage):
            key = keys.setdefault(id(o.tensor), str(len(keys)))
            records[key] = o.tensor
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[o.tensor.dtype])
            return "storage", storage_type, key, "cpu", o.tensor.numel
        if isinstance(o, torch.storage.TypedStorage):
            storage, storage_type, numel = o._untyped_storage, getattr(torch, o._pickle_storage_type()), o._size()
        elif torch.is_storage(o):
            storage, storage_type, numel = o, normalize_storage_type(type(o)), o.nbytes()
        else:
            return None
        key = keys.setdefault(storage._cdata, str(len(keys)))
        records[key] = storage
        return "storage", storage_type, key, location_tag(storage), numel

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            return persistent_id(o)

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)
    data = buffer.getvalue()
    # A str path lets the writer write storages straight from memory; a Python file object (for
    # names that are not ASCII, as in torch.save) goes through a bytes copy of each record.
    name = os.fspath(file)
    stream = None if name.isascii() else open(file, "wb")  # noqa: SIM115 - closed below
    try:
        align = config.save.storage_alignment
        writer = torch._C.PyTorchFileWriter(stream if stream is not None else name, get_crc32_options(), align)
        try:
            _write_records(writer, data, records, on_tensor)
        except BaseException:
            # The writer's destructor finishes the file unless told it is finished; failing
            # again there (a full disk) would be std::terminate. Finish it now, ignoring errors.
            with contextlib.suppress(Exception):
                writer.write_end_of_file()
            raise
        finally:
            del writer
    finally:
        if stream is not None:
            stream.close()
    fsync_file(file)


def _write_records(writer: Any, data: bytes, records: dict[str, Any], on_tensor: Callable[[int], None]) -> None:
    """The records of a torch.save zip after its pickle `data`, in torch.serialization's order."""
    from torch.utils.serialization import config

    align = config.save.storage_alignment
    writer.write_record("data.pkl", data, len(data))
    writer.write_record(".format_version", "1", 1)
    writer.write_record(".storage_alignment", str(align), len(str(align)))
    writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for key, record in records.items():
        if isinstance(record, _Deferred):
            tensor = record.materialize()
            storage = tensor.untyped_storage()
            writer.write_record(f"data/{key}", storage, storage.nbytes())
            on_tensor(storage.nbytes())
            del tensor, storage
        else:
            storage = record if record.device.type == "cpu" else record.cpu()
            writer.write_record(f"data/{key}", storage, storage.nbytes())
    writer.write_end_of_file()


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def _stream_safetensors(
    tensors: dict[str, _Deferred], file: Path, metadata: dict[str, str], on_tensor: Callable[[int], None]
) -> None:
    """A safetensors file (8-byte header length, JSON header, raw little-endian bytes) written
    one tensor at a time: the header's offsets come from the shapes alone. Tied weights are
    written under each name (safetensors has no aliasing)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, deferred in tensors.items():
        if deferred.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor '{name}' has dtype {deferred.dtype}, which safetensors cannot store")
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[deferred.dtype],
            "shape": list(deferred.shape),
            "data_offsets": [offset, offset + deferred.nbytes],
        }
        offset += deferred.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for deferred in tensors.values():
            tensor = deferred.materialize()
            if sys.byteorder != "little":
                raise CheckpointError("safetensors output needs a little-endian machine")
            # numpy's stubs declare ndarray's buffer protocol only for Python >= 3.12.
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
            on_tensor(deferred.nbytes)
            del tensor
        f.flush()
        os.fsync(f.fileno())


# ---- reading whole tensors from the shards --------------------------------------------------
class _Reader(CheckpointReader):
    """The checkpoint's DCP reader (its index read once, not once per tensor), reading whole tensors."""

    def read(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor stored under `key` (flat if it was sharded), read chunk by chunk."""
        target = torch.empty(shape, dtype=dtype)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({key: target}, storage_reader=self, **dcp_no_dist(dcp.load, True))
        except (Exception, dcp.CheckpointException) as err:
            raise CheckpointError(f"reading '{key}' from {self.path} failed: {describe_error(err)}") from err
        return target


def _deferred(reader: _Reader, key: str, info: dict[str, Any], cast: torch.dtype | None = None) -> _Deferred:
    shape, dtype = tuple(info["shape"]), dtype_of(info["dtype"])
    stored = (math.prod(shape),) if info["kind"] == "sharded" else shape
    target = cast if cast is not None and dtype.is_floating_point else dtype
    return _Deferred(shape, target, lambda: reader.read(key, stored, dtype))


def _state_dict(
    ckpt: ShardedCheckpoint, reader: _Reader, objects: dict[str, Any], cast: torch.dtype | None
) -> dict[str, Any]:
    """The module's state dict in its own key order, tied weights under every name (one storage)."""
    out: dict[str, Any] = OrderedDict()
    for entry in ckpt.entries():
        key, kind = entry["key"], entry["kind"]
        if kind == "alias":
            out[key] = out[entry["of"]]
        elif kind == "object":
            out[key] = objects[key]
        else:
            out[key] = _deferred(reader, f"state_dict/{key}", entry, cast)
    return out


def _optimizer_states(ckpt: ShardedCheckpoint, reader: _Reader, objects: list[dict[str, Any]]) -> list[dict]:
    """Each optimizer's `state_dict()` as torch writes it: parameters numbered in param_groups
    order, state tensors whole."""
    states = []
    for index, (meta, objs) in enumerate(zip(ckpt.meta["optimizers"], objects)):
        order = {name: i for i, name in enumerate(n for group in objs["param_groups"] for n in group["params"])}
        state: dict[int, dict[str, Any]] = {}
        for name in sorted(set(meta["state"]) | set(objs["state"]), key=lambda n: order[n]):
            entry = state[order[name]] = dict(objs["state"].get(name, {}))
            for k, info in meta["state"].get(name, {}).items():
                entry[k] = _deferred(reader, f"optimizer_states/{index}/{name}/{k}", info)
        groups = [{**group, "params": [order[n] for n in group["params"]]} for group in objs["param_groups"]]
        states.append({"state": state, "param_groups": groups})
    return states


def deferred_checkpoint(
    ckpt: ShardedCheckpoint, *, weights_only: bool = False, cast: torch.dtype | None = None
) -> dict[str, Any]:
    """The Lightning checkpoint dict `ckpt` was saved from, in its saved key order, with every
    tensor a `_Deferred` that reads it whole from the shards when materialized (tied weights:
    one `_Deferred` under every name). `weights_only` leaves out optimizer states, LR schedulers
    and callback states; `cast` casts the floating-point tensors of the state dict."""
    trainer_state = ckpt.trainer_state()
    reader = _Reader(ckpt.path, trusted=ckpt.trusted, index=ckpt.index)
    state_dict = _state_dict(ckpt, reader, trainer_state["state_dict"], cast)
    extra = dict(trainer_state["extra"])
    optimizer_states = None
    if weights_only:
        for key in ("lr_schedulers", "callbacks"):
            extra.pop(key, None)
    elif ckpt.meta["optimizers"] is not None:
        optimizer_states = _optimizer_states(ckpt, reader, trainer_state["optimizers"])
    return in_saved_order({**trainer_state, "extra": extra}, state_dict, optimizer_states)


def materialized(obj: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """`obj` with every `_Deferred` read into a tensor, one at a time; a `_Deferred` found under
    several names (tied weights) becomes one tensor under each."""
    memo = {} if memo is None else memo
    if isinstance(obj, _Deferred):
        if id(obj) not in memo:
            memo[id(obj)] = obj.materialize()
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        out.update((k, materialized(v, memo)) for k, v in obj.items())
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(materialized(v, memo) for v in obj)
    return obj


# ---- the entry point ------------------------------------------------------------------------
def consolidate_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    weights_only: bool = False,
    dtype: torch.dtype | str | None = None,
    safetensors: bool = False,
    verify: bool = True,
    progress: Callable[[Progress], None] | None = None,
    trusted: bool = False,
) -> ConsolidationSummary:
    """Write the sharded checkpoint `src` (a directory) as one ordinary checkpoint file `dst`,
    loadable with `torch.load` and `LightningModule.load_from_checkpoint`, without
    lightning_zero3 and at any world size. Streams one tensor at a time (Note: streaming
    consolidation).

    Args:
        weights_only: leave out optimizer states, LR schedulers and callback states.
        dtype: cast the floating-point tensors of the state dict (e.g. "bf16"); optimizer
            state keeps its dtype.
        safetensors: write a safetensors file of the state dict instead.
        verify: check every file's CRC-32 against meta.json first.
        progress: called after each tensor is written.
        trusted: unpickle the checkpoint's pickles without restriction (Note: checkpoint trust
            model); only for checkpoints from a trusted source.

    Refused before anything is written: `dst` inside `src` (or `src` itself), a directory, or
    anything that is not a checkpoint file (Note: what a save may replace). A failed write
    (e.g. a full disk) leaves nothing at `dst` but what was there.
    """
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    cast = _parse_dtype(dtype)
    _check_destination(src, dst)
    ckpt = open_sharded(src, verify=verify, trusted=trusted)
    output = deferred_checkpoint(ckpt, weights_only=weights_only or safetensors, cast=cast)
    if safetensors:
        tensors = {k: v for k, v in output["state_dict"].items() if isinstance(v, _Deferred)}
        extra = ckpt.trainer_state()["extra"]
        meta = {"format": "pt", "source": str(src),
                **{k: str(extra[k]) for k in ("epoch", "global_step") if k in extra}}  # fmt: skip
        unique = list(tensors.values())
    else:
        unique = list({id(t): t for t in _find_deferred(output)}.values())
    done = Progress(0, len(unique), 0, sum(t.nbytes for t in unique))

    def on_tensor(nbytes: int) -> None:
        done.tensors_done += 1
        done.bytes_done += nbytes
        if progress is not None:
            progress(done)

    partial = sibling(dst, PARTIAL_SUFFIX)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if safetensors:
            _stream_safetensors(tensors, partial, meta, on_tensor)
        else:
            _stream_torch_save(output, partial, on_tensor)
        replace_path(partial, dst)
    except BaseException as err:
        cause = _write_failure_cause(partial, err) if isinstance(err, RuntimeError) else None
        remove_path(partial)
        if isinstance(err, Exception) and not isinstance(err, CheckpointError):
            detail = f"{cause} ({describe_error(err)})" if cause else describe_error(err)
            raise CheckpointError(f"writing {dst} failed: {detail}; nothing was written there") from err
        raise
    return ConsolidationSummary(
        src=src, dst=dst, world_size=ckpt.world_size, tensors=done.tensors_done, bytes=done.bytes_done,
        file_bytes=dst.stat().st_size, seconds=time.perf_counter() - start,
    )  # fmt: skip


def _write_failure_cause(file: Path, err: RuntimeError) -> str | None:
    """The operating system's reason for a failed write that torch's zip writer reports only as
    "iostream error": one more write at the end of the partial file shows it (a full disk, a
    file size limit, an I/O error); None if that write succeeds or the error was another one."""
    if "iostream error" not in str(err) and "file write failed" not in str(err):
        return None
    try:
        with open(file, "ab") as f:
            f.write(bytes(1 << 16))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe:
        return f"[Errno {probe.errno}] {probe.strerror}"
    return None


def _check_destination(src: Path, dst: Path) -> None:
    """Refuse, before anything is read or written, a `dst` that would overwrite the source
    checkpoint or anything that is not a checkpoint file."""
    real_src, real_dst = src.resolve(), dst.resolve()
    if real_dst == real_src or real_src in real_dst.parents:
        where = "the checkpoint" if real_dst == real_src else "inside the checkpoint"
        raise CheckpointError(
            f"cannot write {dst}: it is {where} {src} being consolidated; choose a destination outside {src}"
        )
    if dst.is_dir():
        raise CheckpointError(f"cannot write {dst}: it is a directory")
    check_replaceable(dst)


def _find_deferred(obj: Any) -> list[_Deferred]:
    if isinstance(obj, _Deferred):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _find_deferred(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _find_deferred(v)]
    return []


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (or a torch.dtype), got {dtype!r}")
    return DTYPES[dtype]


__all__ = ["ConsolidationSummary", "Progress", "consolidate_checkpoint", "deferred_checkpoint", "materialized"]
