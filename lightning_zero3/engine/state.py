"""Whole (unsharded) views of optimizer state, for full checkpoints that load at any world
size. Parameters are handled by `ShardedModel.full_state_dict` / `load_full_state_dict`."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero3.engine.model import ShardedModel
from lightning_zero3.engine.shard import ShardedParam, shard_slice


def gather_shard_tensor(model: ShardedModel, sharded: ShardedParam, shard: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind per-rank `shard`s laid out like `sharded`, gathered on the group's
    device wherever `shard` is (comm.py, Note: collective device)."""
    n = model._comm.world_size
    device = model._comm.device or shard.device
    gathered = torch.empty(n * sharded.shard_numel, dtype=shard.dtype, device=device)
    what = f"state of '{sharded.name}'"
    model._comm.all_gather(gathered, shard.detach().contiguous(), async_op=False, what=what)
    return gathered[: sharded.numel].view(sharded.whole_shape)


def full_optimizer_state(model: ShardedModel, optimizer: torch.optim.Optimizer, *, to_rank: int | None = 0) -> dict:
    """`optimizer.state_dict()` with shard-shaped state gathered whole. Collective; with
    `to_rank`, only that rank gets the result."""
    keep = to_rank is None or model.world_comm.rank == to_rank
    packed = optimizer.state_dict()
    state: dict[int, Any] = {}
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        entry = packed["state"].get(index)
        sharded = model.sharded_param(param)
        if entry is None:
            continue
        entry = dict(entry)  # state_dict() shares the live per-parameter dicts
        if sharded is not None:
            for key, value in entry.items():
                if sharded.is_shard_shaped(value):
                    whole = gather_shard_tensor(model, sharded, value)
                    entry[key] = whole.cpu() if keep else None
        state[index] = entry
    return {"state": state, "param_groups": packed["param_groups"]} if keep else {}


def load_full_optimizer_state(model: ShardedModel, optimizer: torch.optim.Optimizer, full_state: dict) -> None:
    """Load `full_optimizer_state`'s dict (any world size): each rank keeps its slices."""
    state: dict[int, Any] = {}
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        entry = full_state["state"].get(index, full_state["state"].get(str(index)))
        if entry is None:
            continue
        entry = dict(entry)
        sharded = model.sharded_param(param)
        if sharded is not None:
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == sharded.numel:
                    piece = shard_slice(value.reshape(-1), model._comm.rank, model._comm.world_size)
                    entry[key] = piece.to(param.device)
        state[index] = entry
    optimizer.load_state_dict({"state": state, "param_groups": full_state["param_groups"]})
