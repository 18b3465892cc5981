"""Train a sharded model on N ranks and a reference on one process side by side; report the
largest difference of parameters and shard gradients from the reference's, every step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
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


def adamw_large_eps(params: Any) -> torch.optim.Optimizer:
    """AdamW for models with a gradient that is zero in exact arithmetic: attention's key bias
    (softmax ignores a shift shared by all keys). Its computed value is float rounding noise,
    which differs between N ranks and one process just as under DDP, and Adam's first step with
    eps=1e-8 turns any noise into a step of ~lr. eps=1e-4 leaves real gradients' updates intact
    and noise's negligible, so parity measures the engine rather than the noise."""
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, eps=1e-4)


def no_decay_for_biases_and_norms(module: nn.Module) -> list[dict[str, Any]]:
    """AdamW param groups chosen by parameter NAME (shards are all 1-D, so `ndim` cannot tell a
    bias from a weight): no weight decay for biases and normalisation weights."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        owner = name.rsplit(".", 2)[-2] if "." in name else ""  # "blocks.0.norm.weight" -> "norm"
        is_norm = owner.startswith(("norm", "ln"))
        (no_decay if name.endswith("bias") or is_norm else decay).append(param)
    return [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over flattened logits: (B, T, V) x (B, T) -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@dataclass
class Recipe:
    model: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.mse_loss
    optimizer: Callable[[Any], torch.optim.Optimizer] = sgd
    # Builds the optimizer's param groups from the module; None: `module.parameters()`.
    param_groups: Callable[[nn.Module], Any] | None = None
    steps: int = 3
    accumulate: int = 1
    no_sync: bool = False  # micro-batches but the last accumulate unsharded (ShardedModel.no_sync)
    clip_norm: float | None = None
    clip_value: float | None = None
    sharded_kwargs: dict[str, Any] = field(default_factory=dict)


def local_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = t.size(0) // world_size
    return t[rank * size : (rank + 1) * size]


def step_side_by_side(
    reference: nn.Module,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    batch: tuple[torch.Tensor, torch.Tensor],
    rank: int,
    world_size: int,
) -> None:
    """One MSE training step: the reference on the whole batch, the sharded model on this
    rank's slice, then every optimizer steps and zeroes its gradients."""
    x, y = batch
    F.mse_loss(reference(x), y).backward()
    F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def max_param_difference(sharded: ShardedModel, reference: nn.Module) -> float:
    """The largest difference between the sharded model's whole parameters and the reference's."""
    full = sharded.full_state_dict(to_rank=None)
    return max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())


def _optimizer(recipe: Recipe, module: nn.Module) -> torch.optim.Optimizer:
    params = recipe.param_groups(module) if recipe.param_groups is not None else module.parameters()
    return recipe.optimizer(params)


def run_parity(rank: int, world_size: int, recipe: Recipe) -> dict[str, float]:
    """Runs inside each rank. Returns the worst differences seen from the reference:
    `param` (whole parameters after each step), `grad` (each rank's shard gradients against the
    matching slice of the reference gradient, and whole gradients of persistent parameters),
    `loss` and, with clipping, `norm` (global grad norm). Also `min_norm`: the smallest
    reference grad norm seen before clipping, and `clipped`: the fraction of reference gradient
    elements above `clip_value`, so a test can check that clipping actually happened, and `moved`:
how far the reference parameters moved in training, so a test can check that it trained."""
    torch.manual_seed(0)
    reference = recipe.model()
    torch.manual_seed(0)
    model = recipe.model()
    sharded = ShardedModel(model, **recipe.sharded_kwargs)
    ref_opt = _optimizer(recipe, reference)
    opt = _optimizer(recipe, model)
    ref_params = dict(reference.named_parameters())
    initial = {name: value.clone() for name, value in reference.state_dict().items()}
    worst = {"param": 0.0, "grad": 0.0, "loss": 0.0, "norm": 0.0, "min_norm": float("inf"), "clipped": 0.0}
    for step in range(recipe.steps):
        for micro in range(recipe.accumulate):
            x, y = recipe.batch(step * recipe.accumulate + micro)
            ref_loss = recipe.loss(reference(x), y) / recipe.accumulate
            ref_loss.backward()
            unsynced = recipe.no_sync and micro < recipe.accumulate - 1
            with sharded.no_sync() if unsynced else nullcontext():
                out = model(local_slice(x, rank, world_size))
                loss = recipe.loss(out, local_slice(y, rank, world_size)) / recipe.accumulate
                loss.backward()
            mean_loss = loss.detach().clone()
            sharded.world_comm.all_reduce(mean_loss, what="test loss")
            worst["loss"] = max(worst["loss"], abs(float(mean_loss) / world_size - float(ref_loss.detach())))
        if recipe.clip_norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), recipe.clip_norm)
            norm = clip_grad_norm_(sharded, list(model.parameters()), recipe.clip_norm)
            worst["norm"] = max(worst["norm"], abs(float(norm) - float(ref_norm)))
            worst["min_norm"] = min(worst["min_norm"], float(ref_norm))
        if recipe.clip_value is not None:
            grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters() if p.grad is not None])
            worst["clipped"] = max(worst["clipped"], float((grads.abs() > recipe.clip_value).float().mean()))
            torch.nn.utils.clip_grad_value_(reference.parameters(), recipe.clip_value)
            torch.nn.utils.clip_grad_value_(model.parameters(), recipe.clip_value)
        for name, param in model.named_parameters():
            sp = sharded.sharded_param(param)
            ref_grad = ref_params[sp.name if sp is not None else name].grad
            if ref_grad is None or param.grad is None:
                assert (ref_grad is None) == (param.grad is None), f"gradient presence differs for {name}"
                continue
            expected = shard_slice(ref_grad, sp.rank, sp.world_size) if sp is not None else ref_grad
            worst["grad"] = max(worst["grad"], float((param.grad - expected).abs().max()))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        full = sharded.full_state_dict(to_rank=None)
        for name, value in reference.state_dict().items():
            worst["param"] = max(worst["param"], float((full[name] - value).abs().max()))
    worst["moved"] = max(float((value - initial[name]).abs().max()) for name, value in reference.state_dict().items())
    return worst
