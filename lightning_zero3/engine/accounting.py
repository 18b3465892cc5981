"""What a `ShardedModel` should hold and send, predicted from its layout: model state bytes, and
the oracle for a step's traffic (which units are gathered once or twice, kept whole or as a
slice, and the payload bytes: docs/accounting.md). The engine records what it did (record.py);
tests and the summary check that and the measured bytes against this formula. The rules take
`UnitSizes`: the engine's exact rows here, tools/estimate.py's for a model not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_zero3.engine.buffers import size_class
from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.quantize import packed_row_bytes
from lightning_zero3.engine.record import Orders
from lightning_zero3.engine.unit import Unit

__all__ = [
    "UnitSizes",
    "expected_step_bytes",
    "gathers",
    "keeps_whole",
    "live_peak",
    "model_state_bytes",
    "sent_row_bytes",
    "step_bytes",
    "step_buffer_bytes",
    "unit_sizes",
]


def model_state_bytes(
    params: Sequence[torch.Tensor], optimizers: list[torch.optim.Optimizer] | None = None
) -> dict[str, int]:
    """Bytes of `params`, their gradients and their optimizer state."""
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    mine = {id(p) for p in params}
    optim_bytes = sum(
        v.numel() * v.element_size()
        for optimizer in optimizers or []
        for param, state in optimizer.state.items()
        if id(param) in mine
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    total = param_bytes + grad_bytes + optim_bytes
    return {"param": param_bytes, "grad": grad_bytes, "optimizer": optim_bytes, "total": total}


@dataclass(frozen=True)
class UnitSizes:
    """One unit as the rules see it: payload bytes per collective, and its place in the step."""

    gather: int  # one All-Gather over the shard group
    reduce: int  # one Reduce-Scatter of its gradients (0: frozen)
    reduced: int  # this rank's reduced row across shard groups: All-Reduced, or its packed rows All-Gathered
    slice_gather: int = 0  # one All-Gather of the slices inside a group of G (reshard.py)
    backward: bool = True  # runs backward (trainable, or its input needs a gradient)
    ends_forward: bool = False  # backward begins with it: the root, the last unit (hooks.py)


def keeps_whole(unit: UnitSizes, reshard: bool | int) -> bool:
    """hooks.py, Note: kept for backward; reshard.py, Note: reshard after forward."""
    return unit.ends_forward or (reshard is False and unit.backward)


def gathers(unit: UnitSizes, reshard: bool | int) -> tuple[int, int]:
    """All-Gathers per step over the shard group and inside the group of G: forward's, and
    backward's unless kept whole or without backward (with an int `reshard`, of the slices)."""
    if not unit.backward or keeps_whole(unit, reshard):
        return 1, 0
    return (2, 0) if reshard is True else (1, 1)


def step_bytes(
    units: Sequence[UnitSizes],
    reshard: bool | int,
    *,
    persistent: int = 0,
    micro_batches: int = 1,
    synced: int | None = None,
    across: str = "all_reduce",
) -> dict[str, dict[str, int]]:
    """Payload bytes per optimizer step by group, {collective: bytes} each: "shard" (with the
    persistent All-Reduce), "across" (shard groups: `across`, "all_gather" where the gradients
    cross quantized) and "slices" (groups of G). Gathers repeat per pass of `micro_batches`,
    reductions per `synced` pass (default: all)."""
    reduced = micro_batches if synced is None else synced
    counts = [gathers(u, reshard) for u in units]
    shard = {
        "all_gather": micro_batches * sum(k * u.gather for (k, _), u in zip(counts, units)),
        "reduce_scatter": reduced * sum(u.reduce for u in units),
    }
    if persistent:
        shard["all_reduce"] = reduced * persistent
    slices = {"all_gather": micro_batches * sum(k * u.slice_gather for (_, k), u in zip(counts, units))}
    return {"shard": shard, "across": {across: reduced * sum(u.reduced for u in units)}, "slices": slices}


def live_peak(whole: Sequence[int], reshard: bool | int, *, prefetch: int, ends_forward: Sequence[bool]) -> int:
    """Bytes of gathered units alive at the end of forward: the kept ones, the computing one and
    `prefetch` more (the largest); with False all; with an int G, the others' 1/G slices too."""
    if reshard is False:
        return sum(whole)
    kept = [f for f, e in zip(whole, ends_forward) if e]
    rest = sorted((f for f, e in zip(whole, ends_forward) if not e), reverse=True)
    slices = sum(rest) // reshard if type(reshard) is int else 0
    return sum(kept) + sum(rest[: 1 + prefetch]) + slices


def step_buffer_bytes(units: list[Unit], *, prefetch: int, in_flight: int, received: bool) -> int:
    """The pool's bytes at a steady training step's peak (docs/accounting.md, Buffers a step
    holds), reshard_after_forward=True: per role and size class the most buffers in use at once,
    each of the class's widest request (buffers.py, Note: size classes). The root's apart (its
    own classes): one of each. Of the other units' classes: max(prefetch, 1) receive buffers, one
    block, `in_flight` + 1 Reduce-Scatter inputs (and with gloo's transport, `received`, the rows
    each receives)."""
    root, rest = units[0], [u for u in units[1:] if u.params]
    held: dict[tuple[str, int, torch.dtype, bool], tuple[int, int]] = {}  # key -> (at once, widest numel)

    def hold(role: str, count: int, numel: int, dtype: torch.dtype, *, own: bool) -> None:
        key = (role, numel if own else size_class(numel), dtype, own)
        was = held.get(key, (0, 0))
        held[key] = (max(was[0], count), max(was[1], numel))

    for unit in ([root] if root.params else []) + rest:
        own = unit is root
        n, inputs = unit.world_size, 1 if own else in_flight + 1
        hold("gather", 1 if own else max(prefetch, 1), n * unit.row_numel(), unit.param_dtype, own=own)
        hold("block", 1, unit.block_numel, unit.param_dtype, own=own)
        if any(p.requires_grad for p in unit.params):
            hold("reduce", inputs, n * unit.reduce_row_numel, unit.reduce_dtype, own=own)
            if received:
                hold("received", inputs, (n - 1) * unit.reduce_row_numel, unit.reduce_dtype, own=own)
    return sum(count * numel * key[2].itemsize for key, (count, numel) in held.items())


def unit_sizes(units: list[Unit], orders: Orders) -> dict[int, UnitSizes]:
    """The engine's units as `UnitSizes`, from their exact rows (unit.py, Note: flat layout). A
    frozen unit runs backward if the recorded backward order has it (assumed before any)."""
    forward_order, backward_order = orders
    ends = {units[0].uid}  # the root, and the last unit of the order with every unit enclosing it
    if forward_order:
        last = units[forward_order[-1]].module
        ends.update(u.uid for u in units if any(m is last for m in u.module.modules()))
    sizes = {}
    for u in units:
        trainable = any(p.requires_grad for p in u.params)
        n, g = u.world_size, u.slice_comm.world_size if u.slice_comm is not None else 1
        reduced = u.reduce_row_numel * u.reduce_dtype.itemsize * trainable
        if _across_packed(u):  # an All-Gather of R packed rows (quantize.py, Note: quantized collectives)
            assert u.replicate is not None
            reduced = (
                u.replicate.world_size
                * trainable
                * _sent_row(u.replicate, "gradients", u.reduce_row_numel, u.reduce_dtype.itemsize, u.shard_numel)
            )
        sent = _sent_row(u.comm, "weights", u.row_numel(), u.param_dtype.itemsize, u.shard_numel)
        reduce_sent = _sent_row(u.comm, "gradients", u.reduce_row_numel, u.reduce_dtype.itemsize, u.shard_numel)
        sizes[u.uid] = UnitSizes(
            gather=n * sent,
            reduce=n * reduce_sent * trainable,
            reduced=reduced,
            slice_gather=g * u.row_numel(per=n // g) * u.param_dtype.itemsize,
            backward=trainable or backward_order is None or u.uid in backward_order,
            ends_forward=u.uid in ends,
        )
    return sizes


def sent_row_bytes(width: int, itemsize: int, *, data: int, bits: int, block: int) -> int:
    """Bytes of a row of `width` elements as sent: its first `data` packed with `bits` (0: as it
    is; quantize.py, Note: packed row), the rest as they are."""
    return packed_row_bytes(data, (width - data) * itemsize, block=block, bits=bits) if bits else width * itemsize


def _across_packed(unit: Unit) -> bool:
    """Whether `unit`'s gradients cross shard groups quantized."""
    across = unit.replicate
    return across is not None and across.codec("gradients", width=1, itemsize=1, data=0) is not None


def _sent_row(comm: Comm, kind: str, width: int, itemsize: int, data: int) -> int:
    codec = comm.codec(kind, width=width, itemsize=itemsize, data=data)  # None: not quantized here
    bits = codec.bits if codec is not None else 0
    return sent_row_bytes(width, itemsize, data=data, bits=bits, block=comm.quantization.block)


def expected_step_bytes(
    units: list[Unit],
    persistent: Sequence[torch.Tensor],
    *,
    orders: Orders,
    reshard: bool | int = True,
    across_groups: bool = False,
    slices: bool = False,
    micro_batches: int = 1,
    synced: int | None = None,
) -> dict[str, int]:
    """`step_bytes` on the engine's rows, the persistent All-Reduce with one count element per
    parameter (persistent.py). With `across_groups`: what crosses between shard groups (the
    persistent All-Reduce too, which spans all ranks); with `slices`: inside the groups of G."""
    n = units[0].world_size
    hybrid = units[0].replicate is not None
    persistent_bytes = sum((p.numel() + 1) * p.element_size() for p in persistent if p.requires_grad)
    sized = unit_sizes(units, orders)
    across = "all_gather" if _across_packed(units[0]) else "all_reduce"
    by_group = step_bytes(
        [sized[u.uid] for u in units if u.params],
        reshard,
        persistent=persistent_bytes,
        micro_batches=micro_batches,
        synced=synced,
        across=across,
    )
    if slices:
        return by_group["slices"] if units[0].slice_comm is not None else {}
    expected = by_group["shard"]
    persistent_all_reduce = expected.pop("all_reduce", 0)
    if across_groups:
        if not hybrid:
            return {}
        crossing = {**by_group["across"], "all_reduce": by_group["across"].get("all_reduce", 0) + persistent_all_reduce}
        return {k: v for k, v in crossing.items() if v or k == across}
    if persistent_all_reduce and n > 1 and not hybrid:  # with shard groups: counted across them
        expected["all_reduce"] = persistent_all_reduce
    return expected
