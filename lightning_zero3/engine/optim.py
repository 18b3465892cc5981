"""Optimizers on shards: the gradient norm and clipping (the global norm needs one All-Reduce of a
scalar), the optimizers that cannot step on 1-D shards, and a GradScaler whose ranks agree."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import cast

import torch

from lightning_zero3.engine.model import ShardedModel


def grad_norm(model: ShardedModel, parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the gradient of the whole (unsharded) model, the same on every rank, from one
    All-Reduce of a scalar (Note: norms from shards)."""
    order = float(norm_type)
    shares = _local_shares(model, list(parameters), order)
    if order == math.inf:
        local = shares.max() if len(shares) else shares.new_zeros(())
        model.comm.all_reduce(local, what="gradient norm (max)", op="max")
        return local.float()
    local = shares.sum()
    model.comm.all_reduce(local, what="gradient norm")
    return (local ** (1.0 / order)).float()


def grad_norms(
    model: ShardedModel, parameters: list[torch.Tensor], norm_type: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm of each parameter's whole gradient, the norm of all of them together), the
    same on every rank, from one All-Reduce of one value per parameter (Note: norms from
    shards). Parameters without a gradient count as zero (every rank must pass the same list)."""
    order = float(norm_type)
    local = _local_shares(model, parameters, order)
    if order == math.inf:
        model.comm.all_reduce(local, what="gradient norms (max)", op="max")
        return local.float(), (local.max() if len(local) else local.new_zeros(())).float()
    model.comm.all_reduce(local, what="gradient norms")
    return (local ** (1.0 / order)).float(), (local.sum() ** (1.0 / order)).float()


def _local_shares(model: ShardedModel, parameters: list[torch.Tensor], order: float) -> torch.Tensor:
    """This rank's share of each parameter's gradient norm, in float64, one value per parameter.

    [Note: norms from shards]
    Shard gradients are disjoint pieces of the full gradient (padding is zero), so their p-th
    powers summed over ranks are the p-th power of the whole gradient's norm. A parameter kept
    whole has the same gradient on every rank: its share is divided by N, so the sum over ranks
    counts it once. For p = inf the share is the largest absolute value (the max over ranks is
    the whole gradient's); an empty shard (more ranks than elements) or no gradient shares 0.
    `torch._foreach_norm` / `_foreach_mul_` are private: torch's own `clip_grad_norm_` and the
    optimizers' foreach paths use them (tried on torch 2.13); no fallback is kept."""
    device = model.device  # where the collective runs; offloaded shards' gradients are on the host
    n = model.comm.world_size
    if not parameters:
        return torch.zeros(0, dtype=torch.float64, device=device)
    # One foreach norm over the gradients (a few kernels in all, not ~3 per parameter).
    present = [i for i, p in enumerate(parameters) if p.grad is not None and p.grad.numel() > 0]
    grads = [parameters[i].grad.detach() for i in present]  # type: ignore[union-attr]
    wide = None if order == math.inf else torch.float64
    norms = list(torch._foreach_norm(grads, order, dtype=wide)) if grads else []  # private: see above
    whole = [k for k, i in enumerate(present) if model.sharded_param(parameters[i]) is None]
    if whole and order != math.inf:  # counted once over the ranks: share / N = (norm / N^(1/p))^p
        torch._foreach_mul_([norms[k] for k in whole], n ** (-1.0 / order))
    found = dict(zip(present, norms))
    zero = torch.zeros((), dtype=torch.float64, device=device) if len(found) < len(parameters) else None
    shares = [found[i].to(device, torch.float64) if i in found else zero for i in range(len(parameters))]
    stacked = torch.stack(cast(list[torch.Tensor], shares))
    return stacked if order == math.inf else stacked.pow_(order)


def clip_grad_norm_(
    model: ShardedModel, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most `max_norm`; return the norm
    before clipping (like `torch.nn.utils.clip_grad_norm_`)."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(model, params, norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)  # foreach: one multiply per dtype
    return total


# ---- optimizers that cannot step on 1-D shards ------------------------------------------------
# [Note: optimizers that need shapes]
# Every sharded parameter is this rank's 1-D piece (shard.py, Note: shard layout; the decision is
# in docs/design.md, "One-dimensional shards"). Element-wise optimizers (SGD, Adam, AdamW,
# RMSprop, ...) step on it exactly as on the whole parameter. These do not: their update of an
# element depends on the parameter's shape or on all of it, so on shards they would silently
# compute something else (or fail at the first step). Matched by class name, anywhere in the
# optimizer's class hierarchy, since most of them live outside torch.
SHAPE_AWARE_OPTIMIZERS = {
    "Adafactor": "factors its second moment into row and column statistics of each weight matrix",
    "Muon": "orthogonalises each weight matrix (it needs 2-D parameters)",
    "Shampoo": "preconditions each weight matrix by its row and column statistics",
    "DistributedShampoo": "preconditions each weight matrix by its row and column statistics",
    "SOAP": "preconditions each weight matrix by its row and column statistics",
    "Lamb": "scales each update by the norm of the whole parameter (a per-layer trust ratio)",
    "LAMB": "scales each update by the norm of the whole parameter (a per-layer trust ratio)",
    "FusedLAMB": "scales each update by the norm of the whole parameter (a per-layer trust ratio)",
    "LARS": "scales each update by the norm of the whole parameter (a per-layer trust ratio)",
    "Lars": "scales each update by the norm of the whole parameter (a per-layer trust ratio)",
    "LBFGS": "takes dot products over all parameters, which would cover only this rank's pieces",
}


def check_optimizer_fits_shards(optimizer: torch.optim.Optimizer, owner: str, *, warn: bool = True) -> None:
    """Refuse an optimizer of `SHAPE_AWARE_OPTIMIZERS` with a `ValueError` naming `owner` (Note:
    optimizers that need shapes); with `warn`, warn about a param group without parameters, the
    usual sign of a `p.dim() >= 2` filter, which selects no 1-D shard."""
    for cls in type(optimizer).__mro__:
        reason = SHAPE_AWARE_OPTIMIZERS.get(cls.__name__)
        if reason is not None:
            raise ValueError(
                f"{owner} cannot train with {type(optimizer).__name__}: it {reason}, but here each parameter is "
                f"this rank's 1-D piece of the flattened parameter, so its updates would silently differ from a "
                f"single process's. Use an element-wise optimizer (SGD, Adam, AdamW, ...), or train this model "
                f"with DDP or FSDP."
            )
    empty = [i for i, group in enumerate(optimizer.param_groups) if not group["params"]]
    if warn and empty:
        warnings.warn(
            f"{owner}: param group(s) {empty} of {type(optimizer).__name__} hold no parameter. Under ZeRO-3 every "
            f"sharded parameter is 1-D (this rank's piece), so a rule such as `p.dim() >= 2` selects none of "
            f"them: choose groups by parameter name or owning module instead (docs/user-guide.md).",
            stacklevel=3,
        )


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
        for flag in found.values():  # host gradients (offload) have a host flag: agreed on the compute device
            agreed = flag.to(self.sharded_model.device)
            self.sharded_model.world_comm.all_reduce(agreed, what="GradScaler inf/NaN flag", op="max")
            flag.copy_(agreed)

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
