"""What a `ShardedModel` (model.py) holds and sends, counted: the units holding full parameters
now and at the peak (`UnitStats`, kept current by the hooks), the bytes of model state a rank
holds between steps, and the payload bytes per step the design predicts (docs/accounting.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_zero3.engine.model import ShardedModel
    from lightning_zero3.engine.unit import Unit

__all__ = ["LiveUnits", "UnitStats", "expected_step_bytes", "model_state_bytes"]


@dataclass
class UnitStats:
    """How many units hold full parameters (or an in-flight gather) now, and the peak."""

    alive: int = 0
    peak: int = 0
    # The peak not counting the root unit, which is whole for the entire forward and backward.
    peak_without_root: int = 0


class LiveUnits:
    """Calls holding full parameters, per unit, and the units holding some or with a gather in
    flight, counted into `stats`."""

    def __init__(self, units: int, stats: UnitStats) -> None:
        self.calls = [0] * units
        self._alive: set[int] = set()
        self.stats = stats

    def change(self, unit: Unit, delta: int) -> None:
        """`unit` gained (+1) or lost (-1) a call holding full parameters, or a gather in flight
        was issued or dropped (0): only its membership of the alive set changes (was: every unit
        recounted per event, units squared per step; benchmarks/hook_overhead.py)."""
        uid = unit.uid
        self.calls[uid] += delta
        if self.calls[uid] > 0 or unit.gather_in_flight:
            self._alive.add(uid)
        else:
            self._alive.discard(uid)
        s = self.stats
        s.alive = len(self._alive)
        s.peak = max(s.peak, s.alive)
        s.peak_without_root = max(s.peak_without_root, s.alive - (0 in self._alive))

    def reset_peaks(self) -> None:
        self.stats.peak = self.stats.alive
        self.stats.peak_without_root = self.stats.alive - (0 in self._alive)


def model_state_bytes(model: ShardedModel, optimizers: list[torch.optim.Optimizer] | None = None) -> dict[str, int]:
    """Bytes of model state this rank holds between steps: parameter shards (and persistent
    parameters), gradient shards, and optimizer state for them."""
    params = [p.param for p in model.sharded_params] + model.persistent
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


# The recorded (forward, backward) unit orders a step ran with (schedule.py): what the formula
# depends on besides the model's layout.
Orders = tuple[list[int] | None, list[int] | None]


def expected_step_bytes(
    model: ShardedModel, *, across_groups: bool = False, orders: Orders | None = None
) -> dict[str, int]:
    """Payload bytes per training step that the design predicts (Note: flat layout): a
    unit is All-Gathered for forward and again for its backward, except the units kept from
    forward into backward (the root; once an order is recorded, the last unit and the units
    around it too: hooks.py, Note: kept for backward), and Reduce-Scattered once if it has a
    trainable parameter. A frozen unit runs backward only when its input needs a gradient:
    that is read from the recorded backward order (before the first step, it is assumed to).
    Sizes are each rank's row, the padded parameters plus the tag, rounded up to 16 bytes
    (unit.py, Note: flat layout and unit tag). Trainable persistent parameters add one
    All-Reduce of their gradients and one element each (the count of ranks that produced it,
    so that an unused one keeps grad None). With `across_groups` (hierarchical sharding):
    what crosses between shard groups, one All-Reduce of each rank's reduced shard gradients
    (1/G of the gradient), and the persistent parameters' All-Reduce, which runs over all ranks
    (persistent.py). `orders`: the record a step ran with (default: the current one)."""
    forward_order, backward_order = orders or (model.schedule.forward_order, model.schedule.backward_order)
    n = model.comm.world_size
    trainable_persistent = [p for p in model.persistent if p.requires_grad]
    persistent = sum((p.numel() + 1) * p.element_size() for p in trainable_persistent)
    trainable_units = [u for u in model.units if u.params and any(p.requires_grad for p in u.params)]
    if across_groups:
        if model.replicate_comm is None:
            return {}
        shards = sum(u.reduce_row_numel * u.reduce_dtype.itemsize for u in trainable_units)
        return {"all_reduce": shards + persistent}
    expected = {"all_gather": 0, "reduce_scatter": 0}
    kept = _kept_for_backward(model, forward_order)
    for unit in model.units:
        if not unit.params:
            continue
        gather = n * unit.row_numel() * unit.param_dtype.itemsize
        trainable = unit in trainable_units
        has_backward = trainable or backward_order is None or unit.uid in backward_order
        expected["all_gather"] += gather * (2 if has_backward and unit.uid not in kept else 1)
        expected["reduce_scatter"] += n * unit.reduce_row_numel * unit.reduce_dtype.itemsize if trainable else 0
    if persistent and n > 1 and model.replicate_comm is None:  # with shard groups: counted across them
        expected["all_reduce"] = persistent
    return expected


def _kept_for_backward(model: ShardedModel, order: list[int] | None) -> set[int]:
    """Units gathered once per step because backward begins with them (hooks.py, Note: kept for
    backward): the root, and once an order is recorded the last unit to start forward with every
    unit whose module encloses it (their forward ends after it)."""
    kept = {model.units[0].uid}
    if order:
        last = model.units[order[-1]].module
        kept.update(u.uid for u in model.units if any(m is last for m in u.module.modules()))
    return kept
