"""What a `ShardedModel` (model.py) should hold and send, predicted from its layout: the bytes
of model state a rank holds between steps, and the oracle for a step's traffic: which units the
design gathers once or twice, and the payload bytes that follow (docs/accounting.md). The engine
does not evaluate the formula to run; it records what it did (record.py), and tests and the
summary compare that record and the measured bytes (comm.py) with this formula.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_zero3.engine.record import Orders
from lightning_zero3.engine.unit import Unit

__all__ = ["expected_gathers", "expected_kept", "expected_step_bytes", "model_state_bytes"]


def model_state_bytes(
    params: Sequence[torch.Tensor], optimizers: list[torch.optim.Optimizer] | None = None
) -> dict[str, int]:
    """Bytes of model state this rank holds between steps for `params` (its shards and the
    persistent parameters): parameters, gradients, and optimizer state for them."""
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    optim_bytes = 0
    mine = {id(p) for p in params}
    for optimizer in optimizers or []:
        for param, state in optimizer.state.items():
            if id(param) not in mine:
                continue
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    optim_bytes += value.numel() * value.element_size()
    return {
        "param": param_bytes,
        "grad": grad_bytes,
        "optimizer": optim_bytes,
        "total": param_bytes + grad_bytes + optim_bytes,
    }


def expected_kept(units: list[Unit], forward_order: list[int] | None) -> set[int]:
    """Units gathered once per step because backward begins with them (hooks.py, Note: kept for
    backward): the root, and once an order is recorded the last unit to start forward with every
    unit whose module encloses it (their forward ends after it)."""
    kept = {units[0].uid}
    if forward_order:
        last = units[forward_order[-1]].module
        kept.update(u.uid for u in units if any(m is last for m in u.module.modules()))
    return {uid for uid in kept if units[uid].params}


def expected_gathers(units: list[Unit], orders: Orders) -> dict[int, int]:
    """All-Gathers per training step, by unit id: one for forward and one for its backward,
    except the units kept from forward into backward. A frozen unit runs backward only when its
    input needs a gradient: that is read from the recorded backward order (before the first
    step, it is assumed to)."""
    forward_order, backward_order = orders
    kept = expected_kept(units, forward_order)
    gathers = {}
    for unit in units:
        if not unit.params:
            continue
        has_backward = _trainable(unit) or backward_order is None or unit.uid in backward_order
        gathers[unit.uid] = 2 if has_backward and unit.uid not in kept else 1
    return gathers


def _trainable(unit: Unit) -> bool:
    return any(p.requires_grad for p in unit.params)


def expected_step_bytes(
    units: list[Unit],
    persistent: Sequence[torch.Tensor],
    *,
    orders: Orders,
    across_groups: bool = False,
    micro_batches: int = 1,
    synced: int | None = None,
) -> dict[str, int]:
    """Payload bytes per training step that the design predicts: the All-Gathers of
    `expected_gathers` and one Reduce-Scatter per trainable unit, each rank's row (the padded
    parameters plus the check slot, rounded up to 16 bytes: unit.py, Note: flat layout). Trainable
    persistent parameters add one All-Reduce of their gradients and one element each (the count
    of ranks that produced it, so that an unused one keeps grad None). With `across_groups`
    (hierarchical sharding): what crosses between shard groups, one All-Reduce of each rank's
    reduced shard gradients (1/G of the gradient), and the persistent parameters' All-Reduce,
    which runs over all ranks (persistent.py). Per optimizer step of `micro_batches` forward and
    backward passes, of which `synced` (default: all) reduce: the gathers repeat per pass, the
    reductions per synced pass (accumulate.py, Note: unsynced accumulation: k-fold fewer)."""
    reduced = micro_batches if synced is None else synced
    n = units[0].world_size
    hybrid = units[0].replicate is not None
    persistent_bytes = sum((p.numel() + 1) * p.element_size() for p in persistent if p.requires_grad)
    trainable = [u for u in units if u.params and _trainable(u)]
    if across_groups:
        if not hybrid:
            return {}
        shards = sum(u.reduce_row_numel * u.reduce_dtype.itemsize for u in trainable)
        return {"all_reduce": reduced * (shards + persistent_bytes)}
    gathers = expected_gathers(units, orders)
    expected = {
        "all_gather": micro_batches
        * sum(gathers[u.uid] * n * u.row_numel() * u.param_dtype.itemsize for u in units if u.params),
        "reduce_scatter": reduced * sum(n * u.reduce_row_numel * u.reduce_dtype.itemsize for u in trainable),
    }
    if persistent_bytes and n > 1 and not hybrid:  # with shard groups: counted across them
        expected["all_reduce"] = reduced * persistent_bytes
    return expected
