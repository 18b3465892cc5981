"""Whole parameters outside forward: `ShardedModel.gathered_parameters` (model.py), e.g. for a
callback that reads or edits weights between steps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_zero3.engine.buffers import BufferPool
from lightning_zero3.engine.calls import engine_mode
from lightning_zero3.engine.checks import RankChecks
from lightning_zero3.engine.comm import CollectiveError, Comm
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.unit import Unit

__all__ = ["gathered_parameters"]


@contextmanager
def gathered_parameters(
    scope: nn.Module,
    units: list[Unit],
    persistent: list[nn.Parameter],
    *,
    checks: RankChecks,
    world_comm: Comm,
    pool: BufferPool,
    modifier_rank: int | None = None,
) -> Iterator[None]:
    """The parameters under `scope` whole on every rank: the registered parameters hold the whole
    data inside the block, in tensors of their own (not views of a pooled block), so a state dict
    taken inside stays valid after it, as under DeepSpeed's `GatheredParameters`. With
    `modifier_rank=r`, rank r's values are broadcast on exit and kept; otherwise changes are
    discarded. Each `ShardedParam.gathered` says which block holds it whole (Note: whole inside
    gathered_parameters in shard.py). The buffers its gathers add to `pool` go back on entry's end
    (buffers.py, Note: what the pool keeps)."""
    in_scope = {id(p) for p in scope.parameters()}
    chosen = {p for u in units for p in u.params if id(p.param) in in_scope}  # a set: looked up per parameter
    persistent = [p for p in persistent if id(p) in in_scope]
    units = [u for u in units if any(p in chosen for p in u.params)]
    # Persistent parameters are whole already; without a modifier, writes to them must be
    # discarded like writes to gathered ones, or the ranks drift apart.
    saved = [p.detach().clone() for p in persistent] if modifier_rank is None else []
    shards: dict[ShardedParam, torch.Tensor] = {}
    entered = False  # False in `finally`: a gather or tag check failed, so no collective there
    try:
        try:
            with pool.transient():
                for unit in units:
                    with engine_mode():
                        wholes = unit.gather(dtype=unit.shard_dtype)
                        # Each its own storage, so the user's references stay valid; the block goes back.
                        copies = [(s, whole.clone()) for s, whole in zip(unit.params, wholes) if s in chosen]
                        unit.release(wholes)
                    for sharded, whole in copies:
                        shards[sharded] = sharded.param.data
                        sharded.param.data = whole
                        sharded.gathered.append(modifier_rank)
        except CollectiveError as err:  # the usual cause: the block entered on some ranks only
            raise CollectiveError(
                f"gathered_parameters could not gather on rank {world_comm.rank}: every rank must enter it (it gathers "
                f"from all of them), and the ranks that did not were elsewhere (or gone) until the timeout. Entered "
                f"under `if rank == 0:`? Move it out of the `if`, on every rank, and keep only what uses the whole "
                f"weights (e.g. `torch.save`) under `if rank == 0:`. If every rank entered, another rank failed: its "
                f"log holds the cause. The gather's error: {err}"
            ) from err
        checks.check()  # outside any pass: check these gathers now
        entered = True
        yield
    finally:
        written = {sharded: sharded.param.data for sharded in shards}
        for sharded, shard in shards.items():  # every shard back before a broadcast, which may fail
            sharded.param.data = shard
            sharded.gathered.pop()
        if entered and modifier_rank is not None:
            for sharded, whole in written.items():
                world_comm.broadcast(whole, src=modifier_rank, what=f"'{sharded.name}' from rank {modifier_rank}")
                sharded.load_whole(whole)
        if modifier_rank is None:
            with torch.no_grad():
                for p, value in zip(persistent, saved):
                    p.copy_(value)
        elif entered:
            for p in persistent:
                world_comm.broadcast(p.data, src=modifier_rank, what="persistent parameter")
