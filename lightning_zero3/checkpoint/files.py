"""Files of a checkpoint on a local filesystem: checksums, synced writes, temporary names, and
atomic replace and remove (a checkpoint at a path is either the old one or the new one, never a mix).

[Note: temporary names]
Each save writes under a hidden name of its own, created exclusively and `flock`ed, and swaps a
whole checkpoint in, so two jobs never share a name and a sweep removes only provably stale names
of ours (docs/design.md, temporary names).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_zero3.checkpoint.errors import CheckpointError
from lightning_zero3.checkpoint.remote import DATA_PREFIX, RemotePath, as_path, uploading

FORMAT = "lightning_zero3.sharded"  # meta.json's "format"
META_FILE = "meta.json"
PARTIAL_SUFFIX = ".zero3-partial"
_TRASH_SUFFIX = ".zero3-trash"
# The files a save writes into its directory (DCP's shards, its index and the index's temporary
# name; ours and meta.json's temporary name): a leftover directory holding anything else is not ours.
_SAVE_FILE = re.compile(r"__\d+_\d+\.distcp|\.metadata(\.tmp)?|trainer_state\.pt|meta\.json(\.tmp)?")


def crc32(file: Path | RemotePath) -> str:
    value = 0
    with file.open("rb") as f:
        while chunk := f.read(1 << 20):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def checksums(directory: Path | RemotePath, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        file = directory / name
        out[name] = {"bytes": file.stat().st_size, "crc32": crc32(file)}
        if name.startswith("__") and name.endswith(".distcp"):
            out[name]["rank"] = int(name[2:].split("_", 1)[0])
    return out


def fsync_directory(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_synced(file: Path | RemotePath, write: Callable[[Any], object]) -> None:
    """`write(stream)` into `file`, synced; at a URL one upload (Note: remote checkpoints)."""
    if isinstance(file, RemotePath):
        with uploading(file) as stream:
            write(stream)
        return
    with open(file, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomically(obj: dict[str, Any], file: Path | RemotePath) -> None:
    """JSON, each top-level key on a line and each entry of a top-level table on its own; written
    under a temporary name and renamed (at a URL, one PUT: an object is replaced whole)."""
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
    text = ("{\n" + ",\n".join(lines) + "\n}\n").encode()
    tmp = file if isinstance(file, RemotePath) else file.with_name(file.name + ".tmp")
    write_synced(tmp, lambda f: f.write(text))
    if isinstance(tmp, Path) and isinstance(file, Path):
        os.replace(tmp, file)


# ---- temporary names (Note: temporary names) ------------------------------------------------
def _hidden(path: Path, token: str, suffix: str) -> Path:
    return path.with_name(f".{path.name}.{token}{suffix}")


class Partial:
    """A new temporary name next to `path` (a directory, or a file opened for writing as `file`),
    created exclusively and locked by this process until `close()` (Note: temporary names).
    Stale leftovers of earlier saves to `path` are removed first."""

    def __init__(self, path: Path, *, directory: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _parent_locked(path):
            _remove_stale_partials(path)
            self.token = secrets.token_hex(8)
            self.path = _hidden(path, self.token, PARTIAL_SUFFIX)
            if directory:
                os.mkdir(self.path)
                self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            else:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.file = os.fdopen(os.dup(self._fd), "wb") if not directory else None

    def close(self, *, remove: bool) -> None:
        """Release the name; `remove`: delete what is at it (only ever what this save made, or the
        checkpoint the swap took out of the path)."""
        if self.file is not None:
            with contextlib.suppress(OSError):  # after a failed write (a full disk); a good one was synced
                self.file.close()
        if remove and _same_file(self.path, self._fd):
            remove_path(self.path)
        os.close(self._fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


@contextlib.contextmanager
def _parent_locked(path: Path) -> Iterator[None]:
    """An `flock` of `path`'s directory: a name made and locked, or a sweep, as one step to the
    others (Note: temporary names)."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def _remove_stale_partials(path: Path) -> None:
    """Remove the temporary names of earlier saves to `path` that are provably stale and ours
    (Note: temporary names); the caller holds `_parent_locked(path)`."""
    pattern = re.compile(re.escape(f".{path.name}.") + r"[0-9a-f]{16}" + re.escape(PARTIAL_SUFFIX))
    try:
        names = [name for name in os.listdir(path.parent) if pattern.fullmatch(name)]
    except OSError:
        return
    for name in names:
        leftover = path.parent / name
        try:
            fd = os.open(leftover, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a link: ELOOP, left alone
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked by a live save: BlockingIOError
            mode = os.fstat(fd).st_mode
            ours = stat.S_ISREG(mode) or (
                stat.S_ISDIR(mode) and all(_SAVE_FILE.fullmatch(entry) for entry in os.listdir(leftover))
            )
            if ours and _same_file(leftover, fd):
                remove_path(leftover)
        except OSError:
            continue
        finally:
            os.close(fd)


def atomic_write(path: Path | RemotePath, write: Callable[[Any], object]) -> None:
    """`write(stream)` into the file `path` under a temporary name of its own, synced, then swapped
    in (replacing a file or a sharded directory). At a URL, one upload (Note: remote checkpoints)."""
    if isinstance(path, RemotePath):
        with uploading(path) as stream:
            write(stream)
        if path.is_dir():  # a sharded checkpoint there before: the file replaces it
            path.remove_prefix()
        return
    partial = Partial(path, directory=False)
    try:
        assert partial.file is not None
        write(partial.file)
        partial.file.flush()
        os.fsync(partial.file.fileno())
        replace_path(partial.path, path)
    finally:
        partial.close(remove=True)


def atomic_torch_save(obj: Any, path: str | os.PathLike | RemotePath) -> None:
    """`torch.save(obj, path)` by `atomic_write`, refused where a save may not replace what is there."""
    path = as_path(path)
    check_replaceable(path)
    atomic_write(path, lambda f: torch.save(obj, f))


def replace_path(new: Path, path: Path) -> None:
    """Move `new` (a file or directory) to `path`, replacing whatever is there. Atomic where
    the kernel can exchange two names (Linux renameat2): what comes out of `path` is checked to
    be replaceable still (it may have changed since the save began) and put back if not. Elsewhere
    the old one is moved aside first, so a crash leaves either the old or the new checkpoint."""
    if not os.path.lexists(path):
        os.replace(new, path)
    elif _exchange(new, path):
        problem = replace_problem(new)  # what was at `path`, now at `new`
        if problem is not None:
            _exchange(new, path)
            raise CheckpointError(
                f"Refusing to save over {path}: {problem} (it appeared there during the save); it was left as it was"
            )
        remove_path(new)
    else:
        check_replaceable(path)
        if path.is_file() and new.is_file() and not path.is_symlink():
            os.replace(new, path)  # atomic for a file over a file
        else:
            trash = _hidden(path, secrets.token_hex(8), _TRASH_SUFFIX)
            os.rename(path, trash)
            os.rename(new, path)
            remove_path(trash)
    fsync_directory(path.parent)


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


def remove_path(path: Path) -> None:
    """Remove a file, link or checkpoint directory; meta.json first, so that a removal cut
    short never leaves something that looks like a complete checkpoint."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        (path / META_FILE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)


def remove_checkpoint(path: str | os.PathLike | RemotePath) -> None:
    """Remove a checkpoint (a file, a link to one, or a sharded directory). A directory is first
    renamed to a hidden name, so it disappears from `path` at once. Anything that is not
    recognisably a checkpoint (Note: what a save may replace) is refused and left as it is."""
    path = as_path(path)
    check_replaceable(path, action="remove")
    if isinstance(path, RemotePath):
        path.remove()
        return
    if path.is_dir() and not path.is_symlink():
        trash = _hidden(path, secrets.token_hex(8), _TRASH_SUFFIX)
        os.rename(path, trash)
        remove_path(trash)
    else:
        remove_path(path)


# ---- what a save may replace ----------------------------------------------------------------
# [Note: what a save may replace]
# Saving to a path replaces what is there, and ModelCheckpoint's rotation removes old paths; both
# must never destroy a user's files (a mistyped path onto a source tree). Only these are replaced
# or removed: nothing; a link (the link only, never its target); an empty directory; a sharded
# checkpoint directory (meta.json of our format, and nothing in the directory but the files it
# lists); an empty file; a file torch.save wrote (a zip whose records all sit under one folder
# holding data.pkl); a safetensors file. Anything else is refused with a CheckpointError before
# anything is written.
def replace_problem(path: Path | RemotePath) -> str | None:
    """Why saving over (or removing) `path` could destroy something that is not a checkpoint;
    None if it is free or holds a checkpoint."""
    if path.is_symlink() or not path.exists():
        return None
    if path.is_dir():
        entries = sorted(p.name for p in path.iterdir())
        if not entries:
            return None
        meta = own_meta(path)
        if meta is None:
            return f"it is a directory that is not a lightning_zero3 checkpoint (it holds {few(entries)})"
        listed = {META_FILE, *meta["files"]}
        foreign = [e for e in entries if e not in listed and not _data_prefix(path, e)]
        if foreign:
            return f"it is a checkpoint directory that also holds files not of the checkpoint: {few(foreign)}"
        return None
    if not path.is_file():
        return "it is not a regular file"
    if path.stat().st_size == 0 or is_torch_file(path) or is_safetensors_file(path):
        return None
    return "it is a file that is not a checkpoint (neither a torch.save zip archive nor a safetensors file)"


def check_replaceable(path: Path | RemotePath, *, action: str = "save over") -> None:
    problem = replace_problem(path)
    if problem is not None:
        raise CheckpointError(
            f"Refusing to {action} {path}: {problem}. Nothing was changed; choose another path, or move what is "
            f"there away first."
        )


def _data_prefix(path: Path | RemotePath, name: str) -> bool:
    """A save's own prefix under a URL, named by meta.json or left by a save that did not finish."""
    return isinstance(path, RemotePath) and DATA_PREFIX.fullmatch(name) is not None


def own_meta(path: Path | RemotePath) -> dict[str, Any] | None:
    """The meta.json of our format at `path`, or None (read leniently: this only recognises a checkpoint)."""
    if (path / META_FILE).is_symlink():
        return None  # a meta.json elsewhere says nothing of this directory
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(meta, dict) and meta.get("format") == FORMAT and isinstance(meta.get("files"), dict)
    return meta if ok else None


def is_torch_file(path: Path | RemotePath) -> bool:
    """A zip archive as torch.save writes it: every record under one folder that holds data.pkl."""
    try:
        with path.open("rb") as f, zipfile.ZipFile(f) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    folders = {name.split("/", 1)[0] for name in names}
    return len(folders) == 1 and f"{next(iter(folders))}/data.pkl" in names


def is_safetensors_file(path: Path | RemotePath) -> bool:
    """An 8-byte little-endian header length, then a JSON object header that fits the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, 100 << 20):
                return False
            header = json.loads(f.read(length))
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return False
    return isinstance(header, dict) and all(
        isinstance(v, dict) and "data_offsets" in v for k, v in header.items() if k != "__metadata__"
    )


def few(names: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(name) for name in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")
