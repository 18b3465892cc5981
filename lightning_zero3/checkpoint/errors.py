"""`CheckpointError`, and how ranks agree on one before any collective that depends on it.

[Note: no hang on a bad checkpoint]
Each step that can fail on some ranks only is followed by `agree`, so every rank raises the same
error or every rank goes on (docs/design.md, no hang on a bad checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp

from lightning_zero3.engine import Comm


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved, read or loaded; the message names the path and the problem."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing at the checkpoint path on any rank: a `FileNotFoundError` too, as Lightning raises."""


def require_exists(comm: Comm, path: Any, *, context: str) -> None:
    """Raise `CheckpointNotFoundError` on every rank when nothing exists at `path` on any rank
    (a path on one rank only is left to the loading's own checks, which name that rank)."""
    if not any(all_gather_object(comm, path.exists(), context=context)):
        raise CheckpointNotFoundError(f"Checkpoint file not found: {path} (nothing there on any rank)")


def agree(
    comm: Comm | None, error: str | None, *, context: str | None, if_lost: str | None = None, share: Any = None
) -> list[Any]:
    """Raise the same `CheckpointError` on every rank if any rank reports an error, prefixed by
    `context` (by `if_lost` when another rank is gone; no prefix without `comm`); else return
    every rank's `share`, in rank order."""
    lost = if_lost or context or "Checkpoint"
    gathered = all_gather_object(comm, (error, share), context=lost) if comm is not None else [(error, share)]
    failed = [(rank, e) for rank, (e, _) in enumerate(gathered) if e is not None]
    if not failed:
        return [s for _, s in gathered]
    if len(gathered) == 1:
        detail = failed[0][1]
    elif len({e for _, e in failed}) == 1:
        detail = f"{failed[0][1]} (on rank {', '.join(str(r) for r, _ in failed)})"
    else:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
    raise CheckpointError(f"{context}: {detail}" if context is not None and comm is not None else detail)


def all_gather_object(comm: Comm, obj: Any, *, context: str) -> list[Any]:
    """`comm.all_gather_object(obj)`; a rank that died or timed out is a `CheckpointError`."""
    try:
        return comm.all_gather_object(obj)
    except Exception as err:
        raise CheckpointError(f"{context}: another rank stopped answering ({describe_error(err)})") from err


def error_of(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), None), or (None, its error's message) to agree on."""
    try:
        return fn(), None
    except Exception as err:  # noqa: BLE001 - reported to every rank by `agree`
        return None, describe_error(err)


def describe_error(err: BaseException) -> str:
    if isinstance(err, CheckpointError):
        return str(err)
    if isinstance(err, dcp.CheckpointException):  # DCP's agreed failure: each rank's exception
        return "; ".join(f"rank {rank}: {describe_error(exc)}" for rank, (exc, _) in sorted(err.failures.items()))
    if isinstance(err, EOFError):  # pickle's, often with no message: the data ended early
        return f"the file is truncated: its data ends before the pickle does (EOFError: {err or 'no message'})"
    return f"{type(err).__name__}: {err}"


def run_and_agree(comm: Comm | None, fn: Callable[[], Any], *, context: str) -> Any:
    """`fn()` on every rank, then `agree` on its error under `context`."""
    result, error = error_of(fn)
    agree(comm, error, context=context)
    return result
