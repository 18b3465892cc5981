"""Train a sharded model on N ranks and a reference on one process side by side; report the
largest difference of parameters and shard gradients from the reference's, every step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero3.engine import ShardedModel, clip_grad_norm_
from lightning_zero3.engine.shard import shard_slice


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


@dataclass
class Recipe:
    model: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.mse_loss
    optimizer: Callable[[Any], torch.optim.Optimizer] = sgd
    steps: int = 3
    accumulate: int = 1
    clip_norm: float | None = None
    clip_value: float | None = None
    sharded_kwargs: dict[str, Any] = field(default_factory=dict)


def _local(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = t.size(0) // world_size
    return t[rank * size : (rank + 1) * size]


def run_parity(rank: int, world_size: int, recipe: Recipe) -> dict[str, float]:
    """Runs inside each rank. Returns the worst parameter and gradient differences seen."""
    torch.manual_seed(0)
    reference = recipe.model()
    torch.manual_seed(0)
    model = recipe.model()
    sharded = ShardedModel(model, **recipe.sharded_kwargs)
    ref_opt = recipe.optimizer(reference.parameters())
    opt = recipe.optimizer(model.parameters())
    ref_params = dict(reference.named_parameters())
    worst = {"param": 0.0, "grad": 0.0, "loss": 0.0}
    for step in range(recipe.steps):
        for micro in range(recipe.accumulate):
            x, y = recipe.batch(step * recipe.accumulate + micro)
            ref_loss = recipe.loss(reference(x), y) / recipe.accumulate
            ref_loss.backward()
            loss = recipe.loss(model(_local(x, rank, world_size)), _local(y, rank, world_size)) / recipe.accumulate
            loss.backward()
            mean_loss = loss.detach().clone()
            sharded.comm.all_reduce(mean_loss, what="test loss")
            worst["loss"] = max(worst["loss"], abs(float(mean_loss) / world_size - float(ref_loss.detach())))
        if recipe.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), recipe.clip_norm)
            clip_grad_norm_(sharded, list(model.parameters()), recipe.clip_norm)
        if recipe.clip_value is not None:
            torch.nn.utils.clip_grad_value_(reference.parameters(), recipe.clip_value)
            torch.nn.utils.clip_grad_value_(model.parameters(), recipe.clip_value)
        for sp in sharded.sharded_params:
            ref_grad = ref_params[sp.name].grad
            if ref_grad is None or sp.param.grad is None:
                assert (ref_grad is None) == (sp.param.grad is None), f"gradient presence differs for {sp.name}"
                continue
            expected = shard_slice(ref_grad, rank, world_size)
            worst["grad"] = max(worst["grad"], float((sp.param.grad - expected).abs().max()))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        full = sharded.full_state_dict(to_rank=None)
        for name, value in reference.state_dict().items():
            worst["param"] = max(worst["param"], float((full[name] - value).abs().max()))
    return worst
