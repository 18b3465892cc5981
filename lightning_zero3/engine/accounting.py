"""What a `ShardedModel` (model.py) should hold and send, predicted from its layout: the bytes
of model state a rank holds between steps, and the oracle for a step's traffic: which units the
design gathers once or twice, keeps whole or keeps a slice of, and the payload bytes that follow
(docs/accounting.md). The engine does not evaluate the formula to run; it records what it did
(record.py), and tests and the summary compare that record and the measured bytes (comm.py) with
this formula. The rules take unit sizes (`UnitSizes`): the engine's exact rows here, and
estimate.py's sizes for a model that is not built, so both predict by the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zero3.engine.record import Orders
from lightning_zero3.engine.unit import Unit

__all__ = [
    "UnitSizes", "expected_gathers", "expected_kept", "expected_step_bytes", "gathers", "keeps_whole",
    "live_peak", "model_state_bytes", "step_bytes",
]  # fmt: skip


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


@dataclass(frozen=True)
class UnitSizes:
    """One unit as the rules see it: the payload bytes of each collective on it (the full tensor
    each produces or consumes), and its place in the step."""

    gather: int  # one All-Gather over the shard group
    reduce: int  # one Reduce-Scatter of its gradients (0: frozen)
    reduced: int  # this rank's reduced row, All-Reduced across shard groups
    slice_gather: int = 0  # one All-Gather of the slices inside a group of G (reshard.py)
    backward: bool = True  # runs backward (trainable, or its input needs a gradient)
    ends_forward: bool = False  # backward begins with it: the root, the last unit (hooks.py)


def keeps_whole(unit: UnitSizes, reshard: bool | int) -> bool:
    """Whether the unit stays gathered from its forward into its backward (hooks.py, Note: kept
    for backward; reshard.py, Note: reshard after forward)."""
    return unit.ends_forward or (reshard is False and unit.backward)


def gathers(unit: UnitSizes, reshard: bool | int) -> tuple[int, int]:
    """All-Gathers per training step over the shard group and inside the group of G: one for
    forward, and one for backward unless the unit is kept whole or has no backward; with an
    int `reshard` that one gathers the slices."""
    if not unit.backward or keeps_whole(unit, reshard):
        return 1, 0
    return (2, 0) if reshard is True else (1, 1)


def step_bytes(
    units: Sequence[UnitSizes], reshard: bool | int, *, persistent: int = 0, micro_batches: int = 1,
    synced: int | None = None,
) -> dict[str, dict[str, int]]:  # fmt: skip
    """Payload bytes per optimizer step by group: "shard" (the All-Gathers and Reduce-Scatters of
    the shard group, the persistent parameters' All-Reduce), "across" (between shard groups: each
    rank's reduced rows) and "slices" (inside the groups of G), each {collective: bytes}. A step
    of `micro_batches` forward and backward passes, of which `synced` (default: all) reduce: the
    gathers repeat per pass, the reductions per synced pass (accumulate.py, Note: unsynced
    accumulation: k-fold fewer)."""
    reduced = micro_batches if synced is None else synced
    counts = [gathers(u, reshard) for u in units]
    shard = {
        "all_gather": micro_batches * sum(k * u.gather for (k, _), u in zip(counts, units)),
        "reduce_scatter": reduced * sum(u.reduce for u in units),
    }
    if persistent:
        shard["all_reduce"] = reduced * persistent
    slices = {"all_gather": micro_batches * sum(k * u.slice_gather for (_, k), u in zip(counts, units))}
    return {"shard": shard, "across": {"all_reduce": reduced * sum(u.reduced for u in units)}, "slices": slices}


def live_peak(full: Sequence[int], reshard: bool | int, *, prefetch: int, ends_forward: Sequence[bool]) -> int:
    """Bytes of full units alive at once at the end of forward, `full` each unit's full bytes:
    the units kept whole, the computing one and `prefetch` more (the largest of the others);
    with False every unit; with an int G, each other unit's 1/G slice as well."""
    if reshard is False:
        return sum(full)
    kept = [f for f, e in zip(full, ends_forward) if e]
    rest = sorted((f for f, e in zip(full, ends_forward) if not e), reverse=True)
    slices = sum(rest) // reshard if type(reshard) is int else 0
    return sum(kept) + sum(rest[: 1 + prefetch]) + slices


def expected_kept(units: list[Unit], orders: Orders, reshard: bool | int = True) -> set[int]:
    """Units kept whole from forward into backward (hooks.py, Note: kept for backward): the
    root, and once an order is recorded the last unit to start forward with every unit whose
    module encloses it (their forward ends after it); with `reshard=False` every unit that runs
    backward too."""
    sizes = _sizes(units, orders)
    return {u.uid for u in units if u.params and keeps_whole(sizes[u.uid], reshard)}


def expected_gathers(
    units: list[Unit], orders: Orders, reshard: bool | int = True, *, slices: bool = False
) -> dict[int, int]:
    """All-Gathers per training step by unit id, over the shard group (or with `slices` inside
    the groups of G): `gathers`. A frozen unit runs backward only when its input needs a
    gradient: that is read from the recorded backward order (before the first step, it is
    assumed to)."""
    sizes = _sizes(units, orders)
    counts = {u.uid: gathers(sizes[u.uid], reshard)[int(slices)] for u in units if u.params}
    return {uid: k for uid, k in counts.items() if k} if slices else counts


def _ends_forward(units: list[Unit], forward_order: list[int] | None) -> set[int]:
    ends = {units[0].uid}
    if forward_order:
        last = units[forward_order[-1]].module
        ends.update(u.uid for u in units if any(m is last for m in u.module.modules()))
    return ends


def _sizes(units: list[Unit], orders: Orders) -> dict[int, UnitSizes]:
    """The engine's units as `UnitSizes`: each rank's exact rows (padded shards, the check slot,
    16-byte alignment: unit.py, Note: flat layout), times the ranks of each collective."""
    forward_order, backward_order = orders
    ends = _ends_forward(units, forward_order)
    sizes = {}
    for u in units:
        trainable = any(p.requires_grad for p in u.params)
        n, g = u.world_size, u.slice_comm.world_size if u.slice_comm is not None else 1
        reduced = u.reduce_row_numel * u.reduce_dtype.itemsize if trainable else 0
        sizes[u.uid] = UnitSizes(
            gather=n * u.row_numel() * u.param_dtype.itemsize, reduce=n * reduced, reduced=reduced,
            slice_gather=g * u.row_numel(per=n // g) * u.param_dtype.itemsize,
            backward=trainable or backward_order is None or u.uid in backward_order, ends_forward=u.uid in ends,
        )  # fmt: skip
    return sizes


def expected_step_bytes(
    units: list[Unit], persistent: Sequence[torch.Tensor], *, orders: Orders, reshard: bool | int = True,
    across_groups: bool = False, slices: bool = False, micro_batches: int = 1, synced: int | None = None,
) -> dict[str, int]:  # fmt: skip
    """Payload bytes per optimizer step that the design predicts (`step_bytes` on the engine's
    rows): the All-Gathers of `expected_gathers` and one Reduce-Scatter per trainable unit, per
    pass of `micro_batches`, of which `synced` reduce. Trainable persistent parameters add one
    All-Reduce of their gradients and one element each (the count of ranks that produced it, so
    that an unused one keeps grad None). With `across_groups` (hierarchical sharding): what
    crosses between shard groups, one All-Reduce of each rank's reduced shard gradients (1/G of
    the gradient), and the persistent parameters' All-Reduce, which runs over all ranks
    (persistent.py). With `slices` (`reshard_after_forward=G`): the backward's All-Gathers
    inside the groups of G."""
    n = units[0].world_size
    hybrid = units[0].replicate is not None
    persistent_bytes = sum((p.numel() + 1) * p.element_size() for p in persistent if p.requires_grad)
    sized = _sizes(units, orders)
    by_group = step_bytes([sized[u.uid] for u in units if u.params], reshard, persistent=persistent_bytes,
                          micro_batches=micro_batches, synced=synced)  # fmt: skip
    if slices:
        return by_group["slices"] if units[0].slice_comm is not None else {}
    expected = by_group["shard"]
    persistent_all_reduce = expected.pop("all_reduce", 0)
    if across_groups:
        return {"all_reduce": by_group["across"]["all_reduce"] + persistent_all_reduce} if hybrid else {}
    if persistent_all_reduce and n > 1 and not hybrid:  # with shard groups: counted across them
        expected["all_reduce"] = persistent_all_reduce
    return expected
