"""Optimizers on shards: gradient norms and clipping, the optimizers that cannot step on 1-D
shards, and a GradScaler whose ranks agree."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from typing import cast

import torch
from torch.amp.grad_scaler import OptState

from lightning_zero3.engine.model import ShardedModel
from lightning_zero3.engine.whole_matrix import whole_matrix_need


def grad_norm(model: ShardedModel, parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The whole model's gradient norm on every rank, from one All-Reduce of a scalar (Note: norms
    from shards)."""
    order = float(norm_type)
    shares = _local_shares(model, list(parameters), order)
    if order == math.inf:
        local = shares.max() if len(shares) else shares.new_zeros(())
        model._comm.all_reduce(local, what="gradient norm (max)", op="max")
        return local.float()
    local = shares.sum()
    model._comm.all_reduce(local, what="gradient norm")
    return (local ** (1.0 / order)).float()


def grad_norms(
    model: ShardedModel, parameters: list[torch.Tensor], norm_type: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each parameter's whole gradient norm, the total), from one All-Reduce of one value per
    parameter; no gradient counts as zero (every rank passes the same list)."""
    order = float(norm_type)
    local = _local_shares(model, parameters, order)
    if order == math.inf:
        model._comm.all_reduce(local, what="gradient norms (max)", op="max")
        return local.float(), (local.max() if len(local) else local.new_zeros(())).float()
    model._comm.all_reduce(local, what="gradient norms")
    return (local ** (1.0 / order)).float(), (local.sum() ** (1.0 / order)).float()


def _local_shares(model: ShardedModel, parameters: list[torch.Tensor], order: float) -> torch.Tensor:
    """This rank's share of each parameter's gradient norm, in float64.

    [Note: norms from shards]
    Shard gradients are disjoint pieces of the whole gradient (padding is zero): their p-th powers
    summed over ranks are the whole norm's. A whole parameter's share is divided by N; for p = inf
    the share is the largest absolute value. `torch._foreach_norm` / `_foreach_mul_` are private:
    torch's `clip_grad_norm_` uses them (tried on 2.13); no fallback is kept."""
    device = model.device  # where the collective runs; offloaded shards' gradients are on the host
    n = model._comm.world_size
    if not parameters:
        return torch.zeros(0, dtype=torch.float64, device=device)
    present = [i for i, p in enumerate(parameters) if p.grad is not None and p.grad.numel() > 0]
    grads = [parameters[i].grad.detach() for i in present]  # type: ignore[union-attr]
    wide = None if order == math.inf else torch.float64
    norms = list(torch._foreach_norm(grads, order, dtype=wide)) if grads else []  # private: see above
    whole = [k for k, i in enumerate(present) if model.sharded_param(parameters[i]) is None]
    if whole and order != math.inf:  # counted once over the ranks: share / N = (norm / N^(1/p))^p
        torch._foreach_mul_([norms[k] for k in whole], n ** (-1.0 / order))
    by_device: dict[torch.device, list[int]] = {}  # host gradients (offload) and device ones
    for k, norm in enumerate(norms):
        by_device.setdefault(norm.device, []).append(k)
    found: dict[int, torch.Tensor] = {}
    for ks in by_device.values():  # one copy per device, not one per parameter
        moved = torch.stack([norms[k] for k in ks]).to(device, torch.float64)
        found.update((present[k], share) for k, share in zip(ks, moved.unbind()))
    zero = torch.zeros((), dtype=torch.float64, device=device) if len(found) < len(parameters) else None
    shares = [found[i] if i in found else zero for i in range(len(parameters))]
    stacked = torch.stack(cast(list[torch.Tensor], shares))
    return stacked if order == math.inf else stacked.pow_(order)


def clip_grad_norm_(
    model: ShardedModel,
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` with the global norm. `error_if_nonfinite` reads the norm
    on the host (one read, a sync on a GPU, as torch's) to raise before any gradient is scaled."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(model, params, norm_type)
    value = total.item() if error_if_nonfinite else 0.0  # the check and its message read it once
    if not math.isfinite(value):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} of the gradients is non-finite ({value}), so it "
            f"cannot be clipped. Set `error_if_nonfinite=False` to clip anyway."
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)  # foreach: one multiply per dtype
    return total


# ---- optimizers that cannot step on 1-D shards ------------------------------------------------
# [Note: optimizers that need shapes]
# Every sharded parameter is this rank's 1-D piece (docs/design.md, "One-dimensional shards").
# Element-wise optimizers (SGD, Adam, ...) step on it exactly as on the whole parameter; these
# do not (their update depends on the shape or the whole parameter) and would silently compute
# something else. Matched by class name anywhere in the class hierarchy: most live outside torch.
_PRECONDITIONS = "preconditions each weight matrix by its row and column statistics"
_TRUST_RATIO = "scales each update by the norm of the whole parameter (a per-layer trust ratio)"
SHAPE_AWARE_OPTIMIZERS = {
    "Adafactor": "factors its second moment into row and column statistics of each weight matrix",
    "Muon": "orthogonalises each weight matrix (it needs 2-D parameters)",  # torch.optim.Muon's is declared
    "Shampoo": _PRECONDITIONS,
    "DistributedShampoo": _PRECONDITIONS,
    "SOAP": _PRECONDITIONS,
    "Lamb": _TRUST_RATIO,
    "LAMB": _TRUST_RATIO,
    "FusedLAMB": _TRUST_RATIO,
    "LARS": _TRUST_RATIO,
    "Lars": _TRUST_RATIO,
    "LBFGS": "takes dot products over all parameters, which would cover only this rank's pieces",
}


def check_optimizer_fits_shards(
    optimizer: torch.optim.Optimizer, owner: str, *, warn: bool = True, names: Mapping[int, str] | None = None
) -> None:
    """Refuse a shape-aware optimizer that declares no whole-matrix need (whole_matrix.py), naming
    `owner` and its first parameter (`names`: id -> name); with `warn`, warn about an empty
    param group (the usual sign of a `p.dim() >= 2` filter)."""
    for cls in type(optimizer).__mro__:
        reason = SHAPE_AWARE_OPTIMIZERS.get(cls.__name__)
        if reason is not None and whole_matrix_need(optimizer) is None:
            first = next((p for group in optimizer.param_groups for p in group["params"]), None)
            name = (names or {}).get(id(first), "") if first is not None else ""
            which = f" (such as '{name}')" if name else ""
            raise ValueError(
                f"{owner} cannot train with {type(optimizer).__name__}: it {reason}, but here each parameter{which} is "
                f"this rank's 1-D piece of the flattened parameter, so its updates would silently differ from a "
                f"single process's. Only optimizers that declare they need whole matrices are stepped on them "
                f"(torch.optim.Muon; lightning_zero3/engine/whole_matrix.py, Note: whole-matrix steps). Use one of "
                f"those or an element-wise optimizer (SGD, Adam, AdamW, ...), or train this model with DDP or FSDP."
            )
    empty = [i for i, group in enumerate(optimizer.param_groups) if not group["params"]]
    if warn and empty:
        warnings.warn(
            f"{owner}: param group(s) {empty} of {type(optimizer).__name__} hold no parameter. Under ZeRO-3 every "
            f"sharded parameter is 1-D (this rank's piece) outside the Trainer's `configure_optimizers`, so a rule "
            f"such as `p.dim() >= 2` selects none of them there: choose groups by parameter name or owning module "
            f"instead (docs/user-guide.md).",
            stacklevel=3,
        )


class AgreeingGradScaler(torch.amp.GradScaler):
    """A GradScaler whose inf/NaN flag is All-Reduced (max) after unscaling, so every rank skips
    the same steps (else the shards drift apart).

    [Note: every path unscales]
    For fused optimizers `GradScaler.step` (and Lightning's plugin) skips `unscale_` and checks
    rank by rank, so `step` here always unscales first: one unscale pass over the shards.

    [Note: fused steps on the host]
    A fused optimizer is handed GradScaler's flag as a tensor on the loss's device and moves it to
    each parameter's device by a non-blocking copy: for host parameters (offload) a copy into
    pinned memory that the CPU step reads at once, before it lands, so an overflowed step could be
    applied. Such an optimizer is stepped as a non-fused one: the host reads the agreed flags
    (blocking) and skips or steps; the CPU step needs them on the host anyway.

    [Note: private GradScaler state]
    The flag is `_per_optimizer_states[id(optimizer)]["found_inf_per_device"]`, which torch's own
    `step` reads (no public accessor; tried on 2.13.0); the host path above calls torch's own
    `_maybe_opt_step` and marks the stage `OptState.STEPPED` as `step` does. If the layout changes,
    construction raises on every rank alike.
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
        self._unscaled: set[int] = set()  # ids of optimizers agreed on since the last `update()`

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, model: ShardedModel, *, device: str) -> AgreeingGradScaler:
        """An agreeing scaler with `scaler`'s settings and scale, for gradients on `device`."""
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
        if self.is_enabled() and getattr(optimizer, "_step_supports_amp_scaling", False) and _on_host(optimizer):
            # Note: fused steps on the host
            state = self._per_optimizer_states[id(optimizer)]
            stepped = self._maybe_opt_step(optimizer, state, *args, **kwargs)
            state["stage"] = OptState.STEPPED
            return stepped
        return super().step(optimizer, *args, **kwargs)  # type: ignore[arg-type]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(new_scale)
        self._unscaled.clear()

    def __getstate__(self) -> dict[str, object]:
        # The model holds this process's process groups: a pickled scaler leaves it behind.
        return {**super().__getstate__(), "sharded_model": None}


def _on_host(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])
