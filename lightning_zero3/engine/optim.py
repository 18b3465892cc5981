"""Gradient norm and clipping over shards: the global norm needs one All-Reduce of a scalar."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_zero3.engine.model import ShardedModel


def grad_norm(model: ShardedModel, parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the gradient of the whole (unsharded) model, the same on every rank.

    Shard gradients are disjoint pieces of the full gradient (padding is zero), so their
    p-th powers add up across ranks; a parameter kept whole is identical on every rank and
    counts once (its share is divided by N before the sum)."""
    grads_sharded: list[torch.Tensor] = []
    grads_whole: list[torch.Tensor] = []
    for p in parameters:
        if p.grad is None:
            continue
        (grads_sharded if model.sharded_param(p) is not None else grads_whole).append(p.grad.detach())
    device = next(iter(model.module.parameters())).device
    n = model.comm.world_size
    if norm_type == float("inf"):
        local = torch.zeros((), device=device)
        for g in grads_sharded + grads_whole:
            local = torch.maximum(local, g.abs().max().float())
        model.comm.all_reduce(local, what="gradient norm (max)", op="max")
        return local
    p = float(norm_type)
    local = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads_sharded:
        local += torch.linalg.vector_norm(g, p, dtype=torch.float64) ** p
    for g in grads_whole:
        local += torch.linalg.vector_norm(g, p, dtype=torch.float64) ** p / n
    model.comm.all_reduce(local, what="gradient norm")
    return (local ** (1.0 / p)).float()


def grad_norms(
    model: ShardedModel, parameters: list[torch.Tensor], norm_type: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm of each parameter's whole gradient, the norm of all of them together), the
    same on every rank, from one All-Reduce of one value per parameter. Parameters without a
    gradient count as zero (every rank must pass the same list)."""
    device = next(iter(model.module.parameters())).device
    n = model.comm.world_size
    p = float(norm_type)
    local = torch.zeros(len(parameters), dtype=torch.float64, device=device)
    for i, param in enumerate(parameters):
        if param.grad is None:
            continue
        g = param.grad.detach()
        whole = model.sharded_param(param) is None  # the same gradient on every rank
        if p == float("inf"):
            local[i] = g.abs().max().double() if g.numel() else 0.0
        else:
            local[i] = torch.linalg.vector_norm(g, p, dtype=torch.float64) ** p / (n if whole else 1)
    if p == float("inf"):
        model.comm.all_reduce(local, what="gradient norms (max)", op="max")
        return local.float(), local.max().float() if len(local) else torch.zeros((), device=device)
    model.comm.all_reduce(local, what="gradient norms")
    return (local ** (1.0 / p)).float(), (local.sum() ** (1.0 / p)).float()


def clip_grad_norm_(
    model: ShardedModel, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most `max_norm`; return the norm
    before clipping (like `torch.nn.utils.clip_grad_norm_`)."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(model, params, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


class AgreeingGradScaler(torch.amp.GradScaler):
    """A GradScaler whose skip decision is the same on every rank: after unscaling, whether any
    rank found an inf/NaN in its gradient shards is All-Reduced (max). Without it, a rank whose
    shards overflowed skips the step while the others take it, and the shards drift apart."""

    def __init__(self, model: ShardedModel, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.sharded_model = model

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, model: ShardedModel) -> AgreeingGradScaler:
        """An agreeing scaler with `scaler`'s settings (device, initial scale, growth and backoff).
        Note: GradScaler has no public getters for its constructor arguments; they are read from
        its attributes (same names on torch 2.13 and 2.14). Without them, pass a new
        `AgreeingGradScaler(model, ...)` with the settings you want."""
        return cls(
            model, device=scaler._device, init_scale=scaler._init_scale, growth_factor=scaler._growth_factor,
            backoff_factor=scaler._backoff_factor, growth_interval=scaler._growth_interval, enabled=scaler._enabled,
        )  # fmt: skip

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        for flag in found.values():
            self.sharded_model.world_comm.all_reduce(flag, what="GradScaler inf/NaN flag", op="max")
