"""Which modules hold an engine's shards, and making one whole again before it is sharded anew.

[Note: a module left sharded]
`ShardedModel.restore_module` makes the module whole again, but it is a collective: after a run
that failed (other ranks may be gone) the module is left sharded (the Lightning strategies skip the
restore after an exception). DDP users then fit the same module again (resuming from a checkpoint
saved on the exception); a new engine would shard the shards, and the checkpoint would not fit.
So each engine registers its module here while its parameters are shards, and a new engine for a
registered module first asks every rank (one all_gather_object: every rank is building the engine,
so a collective is safe now): left sharded on every rank, the previous engine gathers it whole
and sharding proceeds as for any module; on some ranks only, every rank raises the same error.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_zero3.engine.comm import Comm

if TYPE_CHECKING:
    from lightning_zero3.engine.model import ShardedModel

# Module -> the engine whose shards it holds. Weak keys: a module that is dropped drops out.
_SHARDED_BY: weakref.WeakKeyDictionary[nn.Module, ShardedModel] = weakref.WeakKeyDictionary()


def register(module: nn.Module, engine: ShardedModel) -> None:
    _SHARDED_BY[module] = engine


def unregister(module: nn.Module) -> None:
    _SHARDED_BY.pop(module, None)


def restore_if_left_sharded(module: nn.Module, *, world_comm: Comm, device: torch.device) -> None:
    """Make `module` whole on `device` if an earlier engine left it sharded on every rank; raise
    `RuntimeError` on every rank if only some ranks have it sharded. Collective."""
    previous = _SHARDED_BY.get(module)
    left = world_comm.all_gather_object(previous is not None)
    if not any(left):
        return
    if not all(left):
        ranks = [rank for rank, flag in enumerate(left) if flag]
        raise RuntimeError(
            f"The module's parameters are still the shards of an earlier ShardedModel on ranks {ranks} only (a run "
            f"that failed part-way through setup on some ranks). Build a new module on every rank, and resume its "
            f"state from a checkpoint."
        )
    assert previous is not None
    previous.restore_module(device=device)
