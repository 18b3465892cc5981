"""Modules left holding an engine's shards, made whole again before they are sharded anew.

[Note: a module left sharded]
`restore_module` is a collective, so after a failed run the strategies call `leave_sharded` (hooks
removed, shards kept). (docs/design.md, a module left sharded)
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from lightning_zero3.engine.comm import Comm


class Restorable(Protocol):
    """An engine as `_LEFT` holds it: model.py's `ShardedModel` (which imports this module), by
    the one call made on it here."""

    def restore_module(self, *, device: torch.device | str = "cpu") -> None: ...


# What to do with a module left sharded, unless the caller of `leave_sharded` names its own way.
SHARD_AGAIN = "Shard it again with a new ShardedModel on every rank (which makes it whole first), or load a checkpoint."


def _refuse_forward(engine: Restorable, fix: str, module: nn.Module, args: Any) -> None:  # the hook holds `engine`
    raise RuntimeError(
        f"{type(module).__name__}'s parameters are still this rank's 1-D shards: the run that sharded it ended "
        f"without making it whole. {fix}"
    )


# Module -> (the engine that left it sharded, the hooks holding it: handles with `remove()`).
_LEFT: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[Restorable], list[Any]]] = weakref.WeakKeyDictionary()


def leave_sharded(module: nn.Module, engine: Restorable, fix: str = SHARD_AGAIN) -> None:
    remember_sharded(module, engine, module.register_forward_pre_hook(partial(_refuse_forward, engine, fix)))


def remember_sharded(module: nn.Module, engine: Restorable, handle: Any) -> None:
    """`engine` holds `module` sharded (left, or at rest after `fit`: common/run.py, Note: run
    lifecycle); `handle`, a hook of the module that holds the engine, is removed by `forget`,
    with those remembered before for the same engine."""
    entry = _LEFT.get(module)
    before = entry[1] if entry is not None and entry[0]() is engine else []
    _LEFT[module] = (weakref.ref(engine), [*before, handle])


def holder(module: nn.Module) -> Restorable | None:
    """The engine that holds `module` sharded (left, or at rest), if it is alive."""
    entry = _LEFT.get(module)
    return entry[0]() if entry is not None else None


def forget(module: nn.Module) -> None:
    """`module` is whole again, or sharded by a live engine."""
    entry = _LEFT.pop(module, None)
    for handle in entry[1] if entry is not None else []:
        handle.remove()


def restore_if_left_sharded(module: nn.Module, *, world_comm: Comm, device: torch.device) -> None:
    """Note: a module left sharded. Collective."""
    previous = holder(module)
    left = world_comm.all_gather_object(previous is not None)
    if not any(left):
        return
    if not all(left):
        ranks = [rank for rank, flag in enumerate(left) if flag]
        raise RuntimeError(
            f"{type(module).__name__}'s parameters are still the shards of a failed run on ranks {ranks} only, so it "
            f"cannot be made whole. Build a new module on every rank and load a checkpoint into it."
        )
    assert previous is not None
    previous.restore_module(device=device)
