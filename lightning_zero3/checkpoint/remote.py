"""Checkpoints at fsspec URLs (`s3://`, `gs://`, `memory://`, ...): a handle with the few `Path`
methods the checkpoint code uses, and what replaces a rename on an object store.

[Note: remote checkpoints]
Object stores have no rename: a remote sharded checkpoint is committed by its manifest, meta.json
written last in one PUT, naming a new `shards.<token>` prefix per save, so a reader sees the old
checkpoint or the new one, whole (docs/design.md, remote checkpoints).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # a scheme, at the start
DATA_PREFIX = re.compile(r"shards\.[0-9a-f]{16}")  # a save's own prefix under the URL


def as_path(path: str | os.PathLike | RemotePath) -> Path | RemotePath:
    """A local `Path` (for a path or a `file://` URL) or a `RemotePath` (any other fsspec URL)."""
    if isinstance(path, (Path, RemotePath)):
        return path
    text = os.fspath(path)
    if isinstance(text, str) and _URL.match(text) is not None and not text.startswith(("file://", "local://")):
        return RemotePath(text)
    for scheme in ("file://", "local://"):
        text = text.removeprefix(scheme)
    return Path(text)


class RemotePath:
    """A file or prefix at a URL, with the `Path` methods the checkpoint code calls. Listings are
    never cached across calls: another rank or job may have written since."""

    def __init__(self, url: str, *, fs: Any = None, path: str | None = None) -> None:
        if fs is None:
            from fsspec.core import url_to_fs  # type: ignore[import-untyped]

            try:
                fs, path = url_to_fs(url)
            except (ImportError, ValueError) as err:
                raise ValueError(f"cannot open the checkpoint URL {url}: {err} (install the fsspec backend)") from err
        self.fs = fs
        self.path = (path or "").rstrip("/")

    def _child(self, path: str) -> RemotePath:
        return RemotePath("", fs=self.fs, path=path)

    def _fresh(self) -> Any:
        self.fs.invalidate_cache()
        return self.fs

    def __str__(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))

    def __repr__(self) -> str:  # ConsolidationSummary's and assertion messages' view
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name: str) -> RemotePath:
        return self._child(f"{self.path}/{name}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return self._child(self.path.rsplit("/", 1)[0])

    def resolve(self) -> RemotePath:
        return self

    def exists(self) -> bool:
        return bool(self._fresh().exists(self.path))

    def is_dir(self) -> bool:
        return bool(self._fresh().isdir(self.path))

    def is_file(self) -> bool:
        return bool(self._fresh().isfile(self.path))

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=int(self.fs.size(self.path)))

    def iterdir(self) -> Iterator[RemotePath]:
        listed = (p.rstrip("/") for p in self._fresh().ls(self.path, detail=False))
        return (self._child(p) for p in listed if p != self.path)

    def open(self, mode: str = "rb") -> IO[Any]:
        return self.fs.open(self.path, mode)  # type: ignore[no-any-return]

    def read_bytes(self) -> bytes:
        with self.open("rb") as f:
            return f.read()  # type: ignore[no-any-return]

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def remove(self) -> None:
        """Delete the object at this URL and everything under it as a prefix."""
        self.remove_object()
        self.remove_prefix()

    def remove_object(self) -> None:
        if self._fresh().isfile(self.path):
            self.fs.rm_file(self.path)

    def remove_prefix(self) -> None:
        """Delete every object under `URL/`, meta.json first (a removal cut short never leaves what
        looks like a complete checkpoint), not the object at the URL itself; and abort the uploads
        left open there."""
        self.abort_uploads()
        under = [p for p in self._fresh().find(self.path) if p.startswith(f"{self.path}/")]
        manifest = f"{self.path}/meta.json"
        if manifest in under:
            self.fs.rm_file(manifest)
        rest = [p for p in under if p != manifest]
        if rest:
            self.fs.rm(rest)
        self.fs.invalidate_cache()

    def abort_uploads(self) -> None:
        """Abort the multipart uploads open under `URL/` (DCP's shard files, when a part or the
        upload's completion failed): no object shows them, but S3 keeps and bills their parts until
        they are aborted. Only S3 (s3fs) has them."""
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return
        bucket, _, key = self.path.partition("/")
        listed = call("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/")
        for upload in listed.get("Uploads", []):
            call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


@contextlib.contextmanager
def uploading(file: RemotePath) -> Iterator[IO[bytes]]:
    """A stream whose object appears at `file` only if the block ends without an exception: an
    upload cut short (an exception, a killed process) is discarded by the store, never committed."""
    stream = file.fs.open(file.path, "wb")
    try:
        yield stream
    except BaseException:
        discard = getattr(stream, "discard", None)
        if discard is not None:
            discard()
            stream.closed = True  # nothing left to flush
        raise
    stream.close()


__all__ = ["DATA_PREFIX", "RemotePath", "as_path", "uploading"]
