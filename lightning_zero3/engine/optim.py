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
            if g.numel():  # an empty shard (more ranks than elements) has no maximum
                local = torch.maximum(local, g.abs().max().float())
        model.comm.all_reduce(local, what="gradient norm (max)", op="max")
        return local
    order = float(norm_type)
    local = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads_sharded:
        local += torch.linalg.vector_norm(g, order, dtype=torch.float64) ** order
    for g in grads_whole:
        local += torch.linalg.vector_norm(g, order, dtype=torch.float64) ** order / n
    model.comm.all_reduce(local, what="gradient norm")
    return (local ** (1.0 / order)).float()


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
        assert p.grad is not None
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


class AgreeingGradScaler(torch.amp.GradScaler):
    """A GradScaler whose skip decision is the same on every rank: after unscaling, whether any
    rank found an inf/NaN in its gradient shards is All-Reduced (max). Without it, a rank whose
    shards overflowed skips the step while the others take it, and the shards drift apart.

    [Note: every path unscales]
    `GradScaler.step` has two paths. For ordinary optimizers it calls `unscale_` (unless the user
    did), so the agreement above runs. For optimizers that unscale inside their own kernel
    (`_step_supports_amp_scaling`: fused Adam/AdamW/SGD), it skips `unscale_` and checks the
    gradients itself, rank by rank; Lightning's MixedPrecision plugin also skips `unscale_` for
    them. So `step` here always unscales first (once per optimizer and iteration): the inf flag
    is agreed on before every step, and torch then hands the fused kernel the agreed flag and no
    scale (the gradients are already unscaled). Cost: one unscale pass over the gradient shards
    (1/N of the model), which the fused kernel would otherwise have folded into the step.

    [Note: private GradScaler state]
    The flag is `_per_optimizer_states[id(optimizer)]["found_inf_per_device"]`, the tensors torch's
    own `step` and `update` read; torch has no public accessor for it. Tried: torch 2.13.0. If a
    torch release changes that layout, construction raises (on every rank alike, so no rank
    hangs) telling to use bf16 instead of fp16, rather than letting ranks decide apart.
    """

    def __init__(self, model: ShardedModel, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        factory = getattr(getattr(self, "_per_optimizer_states", None), "default_factory", None)
        if not callable(factory) or "found_inf_per_device" not in factory():
            raise RuntimeError(
                f"{type(self).__name__}: this torch ({torch.__version__}) keeps GradScaler's inf/NaN flags "
                f"differently from the versions this package knows (2.13), so ranks could not agree on "
                f"skipping a step. Use precision='bf16-mixed' (no loss scaling), or a tested torch version."
            )
        self.sharded_model = model
        # Optimizers unscaled (and agreed on) since the last `update()`, by id.
        self._unscaled: set[int] = set()

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, model: ShardedModel, *, device: str) -> AgreeingGradScaler:
        """An agreeing scaler with `scaler`'s settings and current scale (read through its public
        `state_dict()`), for gradients on `device` ("cuda", "cpu", ...)."""
        agreeing = cls(model, device=device, enabled=scaler.is_enabled())
        if scaler.is_enabled():
            agreeing.load_state_dict(scaler.state_dict())
        return agreeing

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        self._unscaled.add(id(optimizer))
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        for flag in found.values():
            self.sharded_model.world_comm.all_reduce(flag, what="GradScaler inf/NaN flag", op="max")

    def step(self, optimizer: torch.optim.Optimizer, *args: object, **kwargs: object) -> float | None:
        if self.is_enabled() and id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)  # Note: every path unscales
        return super().step(optimizer, *args, **kwargs)  # type: ignore[arg-type]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(new_scale)
        self._unscaled.clear()

    def __getstate__(self) -> dict[str, object]:
        # The model holds this process's process groups: a pickled scaler leaves it behind.
        return {**super().__getstate__(), "sharded_model": None}
