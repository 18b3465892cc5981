"""Writers that produce one tensor at a time: a file in `torch.save`'s format or a safetensors
file whose tensors are `Deferred`, read only when their bytes are written (consolidate.py,
Note: streaming consolidation)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, BinaryIO, SupportsIndex

import torch

from lightning_zero3.checkpoint.errors import CheckpointError


class Deferred:
    """A tensor of known shape and dtype whose data `produce()` returns when it is written."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        produce: Callable[[], torch.Tensor],
        *,
        requires_grad: bool = False,
    ) -> None:
        self.shape, self.dtype, self.produce, self.requires_grad = tuple(shape), dtype, produce, requires_grad
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * torch.empty(0, dtype=dtype).element_size()

    def materialize(self) -> torch.Tensor:
        tensor = self.produce().detach().to("cpu", self.dtype).reshape(self.shape).contiguous()
        if tensor.untyped_storage().nbytes() != self.nbytes:
            tensor = tensor.clone()  # a view of a bigger storage: write only this tensor's bytes
        return tensor

    def write(self, write: Callable[[memoryview], object], on_tensor: Callable[[int], None]) -> None:
        """Produce the tensor, hand its bytes to `write` and report them; freed on return."""
        tensor = self.materialize()
        # numpy's stubs declare ndarray's buffer protocol only for Python >= 3.12.
        write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        on_tensor(self.nbytes)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # Pickled as torch pickles a contiguous CPU tensor (Note: the torch.save file format).
        stride = tuple(math.prod(self.shape[i + 1 :]) for i in range(len(self.shape)))
        storage = DeferredStorage(self)
        return torch._utils._rebuild_tensor_v2, (storage, 0, self.shape, stride, self.requires_grad, OrderedDict())


class DeferredStorage:
    def __init__(self, tensor: Deferred) -> None:
        self.tensor = tensor


@functools.cache
def _storage_classes() -> dict[torch.dtype, type]:
    """dtype -> the public storage class torch.save names for it (torch.FloatStorage, ...);
    reading their dtype warns that TypedStorage is deprecated."""
    classes: dict[torch.dtype, type] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name in dir(torch):
            cls = getattr(torch, name) if name.endswith("Storage") else None
            if isinstance(cls, type) and issubclass(cls, torch.TypedStorage) and cls is not torch.TypedStorage:
                dtype = getattr(cls, "dtype", None)
                if isinstance(dtype, torch.dtype):
                    classes.setdefault(dtype, cls)
    return classes


def stream_torch_save(obj: Any, f: BinaryIO, on_tensor: Callable[[int], None]) -> None:
    """`torch.save(obj, f)` where `obj` may hold `Deferred` tensors, written one storage
    at a time. Plain tensors are written the same way; other tensor types (sparse, quantized,
    subclasses) are refused. Readable by plain `torch.load` (with weights_only and mmap too).

    [Note: the torch.save file format]
    We write torch.save's zip records ourselves so each storage is made, written and freed in turn
    (docs/design.md, the torch.save file format). Private: `torch._utils._rebuild_tensor_v2`, which
    the format names in every file (torch 2.13); it replaces `torch._C.PyTorchFileWriter`, over the
    memory bound in 2.10.
    """
    records: dict[str, Deferred] = {}  # storage key -> tensor, in pickling order
    storage_class = _storage_classes()

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, DeferredStorage):
                key = str(len(records))
                records[key] = o.tensor
                if o.tensor.dtype not in storage_class:
                    raise CheckpointError(
                        f"cannot write a tensor of dtype {o.tensor.dtype}: torch has no storage class for it"
                    )
                return "storage", storage_class[o.tensor.dtype], key, "cpu", o.tensor.numel
            if isinstance(o, (torch.TypedStorage, torch.UntypedStorage)):
                raise CheckpointError(
                    "the checkpoint holds a tensor that is not a plain dense tensor (sparse, quantized or a "
                    "subclass) outside its state dict; consolidation writes plain tensors only"
                )
            return None

        def reducer_override(self, o: Any) -> Any:
            # Plain tensors in the checkpoint's other entries (callback and loop states).
            if type(o) is torch.Tensor and o.layout == torch.strided and not o.is_quantized:
                return Deferred(o.shape, o.dtype, lambda: o, requires_grad=o.requires_grad).__reduce_ex__(2)
            return NotImplemented

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)  # each Deferred is pickled once (pickle's memo)
    from torch.utils.serialization import config

    alignment = int(config.save.storage_alignment)
    archive = zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED)

    def record(name: str, data: bytes | memoryview) -> None:
        info = zipfile.ZipInfo(f"archive/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = len(data) if isinstance(data, bytes) else data.nbytes
        # The data starts after the 30-byte local header, the name, our padding field and the
        # 20-byte ZIP64 field that force_zip64 adds: pad it to the storage alignment, with an
        # extra field of its own ID (0x4246, as torch's writer does).
        padding = -(f.tell() + 30 + len(info.filename.encode()) + 4 + 20) % alignment
        info.extra = struct.pack("<HH", 0x4246, padding) + b"Z" * padding
        with archive.open(info, "w", force_zip64=True) as out:
            assert f.tell() % alignment == 0, "record data not aligned"
            out.write(data)

    try:
        for name, data in (
            ("data.pkl", buffer.getvalue()),
            (".format_version", b"1"),
            (".storage_alignment", str(alignment).encode()),
            ("byteorder", sys.byteorder.encode()),
        ):
            record(name, data)
        del buffer
        for key, deferred in records.items():
            deferred.write(functools.partial(record, f"data/{key}"), on_tensor)
        record("version", b"3\n")
        archive.close()
    except BaseException:
        with contextlib.suppress(Exception):  # a second failure (a full disk): the caller removes the file
            archive.close()
        raise


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def stream_safetensors(
    tensors: dict[str, Deferred], f: BinaryIO, metadata: dict[str, str], on_tensor: Callable[[int], None]
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
    if sys.byteorder != "little":
        raise CheckpointError("safetensors output needs a little-endian machine")
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)
    for deferred in tensors.values():
        deferred.write(f.write, on_tensor)


def find_deferred(obj: Any) -> list[Deferred]:
    if isinstance(obj, Deferred):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in find_deferred(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in find_deferred(v)]
    return []


def materialized(obj: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """`obj` with every `Deferred` read into a tensor, one at a time; a `Deferred` found under
    several names (tied weights) becomes one tensor under each."""
    memo = {} if memo is None else memo
    if isinstance(obj, Deferred):
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


__all__ = ["Deferred", "find_deferred", "materialized", "stream_safetensors", "stream_torch_save"]
