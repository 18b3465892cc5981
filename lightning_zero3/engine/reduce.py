"""The Reduce-Scatter of one `Unit` (unit.py): its full gradients -> this rank's averaged shard
gradients, then with shard groups an All-Reduce of them across groups. The rows' layout and
the tag column: unit.py, Note: flat layout and unit tag; the reduce dtype and tag code: unit.py,
Note: dtypes. The Reduce-Scatters of a whole backward, in flight: reductions.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zero3.engine.comm import Works

if TYPE_CHECKING:
    from lightning_zero3.engine.unit import Unit

__all__ = ["PendingReduce", "finish_reduce", "start_reduce", "start_replication"]


@dataclass(eq=False)
class PendingReduce:
    """A Reduce-Scatter (then, with shard groups, an All-Reduce) in flight. `full` and the
    gradients are kept until the wait: the collective and the copy-in read them on their streams."""

    work: dist.Work | Works | None  # None: nothing to wait for (one rank)
    out: torch.Tensor
    full: torch.Tensor
    grads: list[torch.Tensor | None] = field(default_factory=list)
    done: object = None  # event after the last queued operation (CUDA), else None
    scattered: bool = False


def start_reduce(unit: Unit, grads: list[torch.Tensor | None]) -> PendingReduce:
    """Issue the Reduce-Scatter of `unit`'s full gradients asynchronously (None: no gradient,
    sent as zeros); `finish_reduce` waits and returns the shard gradients. With shard groups,
    the All-Reduce across groups follows without waiting on the host (Note: streams)."""
    like = unit.params[0].param
    n, width, s = unit.world_size, unit.reduce_row_numel, unit.shard_numel
    comm = unit.comm
    comm.advance_reductions()  # older reductions' All-Reduces go out first, in order
    streams = comm.streams(like.device)
    out = torch.empty(width, dtype=unit.reduce_dtype, device=like.device)  # on the compute stream
    with streams.on("reduce"), torch.no_grad():
        full = unit.pool.take(n * width, unit.reduce_dtype, like.device).view(n, width)  # (N, row)
        # One copy: each gradient, padded to N x shard, as its (N, shard) column block.
        blocks = []
        zero = full.new_zeros(())  # a parameter without a gradient (frozen): zeros, not allocated per parameter
        for p, grad in zip(unit.params, grads):
            if grad is None:
                blocks.append(zero.expand(n, p.shard_numel))
                continue
            flat = grad.reshape(-1)
            if p.numel != n * p.shard_numel:
                flat = F.pad(flat, (0, n * p.shard_numel - p.numel))
            blocks.append(flat.view(n, p.shard_numel))
        torch.cat(blocks, dim=1, out=full[:, :s])  # casts to reduce_dtype
        full[:, s:].zero_()
        full[(comm.rank + 1) % n, s] = unit.reduce_code  # the next rank checks it
        work = comm.reduce_scatter(out, full, what=f"gradients of unit '{unit.name}'", async_op=True)
        done = streams.event()
    pending = PendingReduce(work=work, out=out, full=full, grads=grads, done=done)
    if unit.replicate is not None:
        comm.awaiting_replication.append((unit, pending))
        if streams.enabled:
            comm.advance_reductions()  # stream-ordered: no host wait
    return pending


def _wait_reduction(
    unit: Unit, pending: PendingReduce, collective: str, what: str, code: int, stream: str | None
) -> None:
    """Wait for `pending`'s collective in flight (on `stream`, None: the current one) and
    record the tag column it brought, which must read `code` (tags.py)."""
    streams = unit.comm.streams(pending.out.device)
    try:
        with streams.on(stream, wait_current=False):
            streams.wait_for(pending.done)
            if pending.work is not None:
                pending.work.wait()
            received = pending.out[unit.shard_numel :][:1].to(torch.int64)
            pending.done = streams.event()
    except RuntimeError as err:
        unit.comm.tags.raise_pending_mismatch()
        raise unit.comm.failed(collective, what, err) from err
    unit.comm.tags.expect(collective, unit.name, received, [code])


def _wait_scatter(unit: Unit, pending: PendingReduce) -> None:
    """Wait for the Reduce-Scatter itself; record the tag it brought (tags.py)."""
    if pending.scattered:
        return
    pending.scattered = True
    what, stream = f"gradients of unit '{unit.name}'", "reduce" if unit.replicate is not None else None
    _wait_reduction(unit, pending, "Reduce-Scatter", what, unit.reduce_code, stream)


def start_replication(unit: Unit, pending: PendingReduce) -> None:
    """With shard groups: once the Reduce-Scatter is done, All-Reduce this rank's piece with
    the same piece in the other groups, asynchronously (comm.advance_reductions)."""
    assert unit.replicate is not None
    _wait_scatter(unit, pending)
    streams = unit.comm.streams(pending.out.device)
    with streams.on("reduce", after=pending.done, wait_current=False):  # not behind the compute
        what = f"gradients of unit '{unit.name}' across shard groups"
        pending.work = unit.replicate.all_reduce(pending.out, what=what, async_op=True)
        pending.done = streams.event()


def finish_reduce(unit: Unit, pending: PendingReduce) -> list[torch.Tensor | None]:
    """Wait for `start_reduce`'s collectives; return this rank's averaged shard gradients in
    the shard dtype (views of one flat buffer), None where no gradient was given."""
    n = unit.world_size
    if unit.replicate is not None:
        unit.comm.advance_reductions(until=pending)
        groups = unit.replicate.world_size
        what = f"gradients of unit '{unit.name}' across shard groups"
        _wait_reduction(unit, pending, "All-Reduce", what, unit.reduce_code * groups, None)
        n *= groups
    else:
        _wait_scatter(unit, pending)
        unit.comm.streams(pending.out.device).wait_for(pending.done)
    # The current stream has waited for every use of `full` and of the gradients.
    unit.pool.give(pending.full.view(-1))
    present = [g is not None for g in pending.grads]
    pending.grads = []
    out = pending.out[: unit.shard_numel]
    out.div_(n)  # sum over all ranks / N: the same average DDP takes
    if out.dtype != unit.shard_dtype:
        out = out.to(unit.shard_dtype)
    return [
        out[o : o + p.shard_numel] if present else None for p, o, present in zip(unit.params, unit.offsets, present)
    ]
