"""Whole (unsharded) views of optimizer state, for full checkpoints that load at any world
size. Parameters are handled by `ShardedModel.full_state_dict` / `load_full_state_dict`."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero3.engine.model import ShardedModel
from lightning_zero3.engine.shard import ShardedParam, shard_slice


def gather_shard_tensor(model: ShardedModel, sharded: ShardedParam, shard: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind per-rank `shard`s laid out like `sharded` (one All-Gather), on the
    group's device wherever `shard` is: after `fit`, Lightning's teardown has moved optimizer
    state to the host, which NCCL cannot send (comm.py, Note: collective device). The shard is
    copied into its row of the output, one tensor at a time."""
    n = model.comm.world_size
    device = model.comm.device or shard.device
    gathered = torch.empty(n * sharded.shard_numel, dtype=shard.dtype, device=device)
    what = f"state of '{sharded.name}'"
    work = model.comm.all_gather(gathered, shard.detach().contiguous(), async_op=False, what=what)
    model.comm.wait(work)
    return gathered[: sharded.numel].view(sharded.full_shape)


def _params_in_state_dict_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(model: ShardedModel, optimizer: torch.optim.Optimizer, *, to_rank: int | None = 0) -> dict:
    """`optimizer.state_dict()` with every shard-shaped state tensor gathered to the full
    parameter shape. Every rank must call it; with `to_rank`, only that rank gets the result."""
    keep = to_rank is None or model.global_rank == to_rank
    packed = optimizer.state_dict()
    state: dict[int, Any] = {}
    for index, param in enumerate(_params_in_state_dict_order(optimizer)):
        entry = packed["state"].get(index)
        sharded = model.sharded_param(param)
        if entry is None:
            continue
        entry = dict(entry)  # state_dict() shares the live per-parameter dicts
        if sharded is not None:
            for key, value in entry.items():
                if sharded.is_shard_shaped(value):
                    full = gather_shard_tensor(model, sharded, value)
                    entry[key] = full.cpu() if keep else None
        state[index] = entry
    return {"state": state, "param_groups": packed["param_groups"]} if keep else {}


def load_full_optimizer_state(model: ShardedModel, optimizer: torch.optim.Optimizer, full_state: dict) -> None:
    """Load a state dict written by `full_optimizer_state` (at any world size): each rank keeps
    its slice of every full-shaped state tensor."""
    state: dict[int, Any] = {}
    for index, param in enumerate(_params_in_state_dict_order(optimizer)):
        entry = full_state["state"].get(index, full_state["state"].get(str(index)))
        if entry is None:
            continue
        entry = dict(entry)
        sharded = model.sharded_param(param)
        if sharded is not None:
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == sharded.numel:
                    piece = shard_slice(value.reshape(-1), model.comm.rank, model.comm.world_size)
                    entry[key] = piece.to(param.device)
        state[index] = entry
    optimizer.load_state_dict({"state": state, "param_groups": full_state["param_groups"]})
