"""Reducing gradients: a unit's whole gradients -> this rank's averaged shard gradients
(Reduce-Scatter, with shard groups then an All-Reduce across them); `Reductions` in flight.

[Note: asynchronous reduction]
`GatherParams.backward` only starts a unit's Reduce-Scatter and returns no gradient; the next unit's
backward computes meanwhile. (docs/design.md, asynchronous reduction)

[Note: gradient copy-in]
The whole gradients are copied into the Reduce-Scatter input on the compute stream (as FSDP2 does) and
the reduce stream waits for the copy: autograd frees them as soon as `GatherParams.backward` returns;
only the inputs stay in flight. (docs/design.md, gradient copy-in)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from lightning_zero3.engine.buffers import BufferPool
from lightning_zero3.engine.unit import ShardSource, Unit

__all__ = ["PendingReduce", "Reductions", "Summed", "grad_blocks", "pack_gradients"]

_chunk_cat = getattr(torch, "_chunk_cat", None)  # private: unit.py, Note: one kernel per copy


@dataclass(eq=False)
class Summed:
    """A unit's whole gradients summed with sync off (accumulate.py), as the input's (N, S) columns."""

    total: torch.Tensor
    present: list[bool]  # which parameters had a gradient in any of them


def grad_blocks(unit: Unit, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each gradient padded and viewed as its (N, shard) column block (None stays None)."""
    n, blocks = unit.world_size, list[torch.Tensor | None]()
    for p, grad in zip(unit.params, grads):
        if grad is None:
            blocks.append(None)
            continue
        flat = grad.reshape(-1)
        if p.numel != n * p.shard_numel:
            flat = F.pad(flat, (0, n * p.shard_numel - p.numel))
        blocks.append(flat.view(n, p.shard_numel))
    return blocks


def pack_gradients(unit: Unit, grads: list[torch.Tensor | None], whole: torch.Tensor, tail: torch.Tensor) -> None:
    """The Reduce-Scatter input `whole` (N, row): each gradient (None: zeros) padded to its
    (N, shard) column block, cast to `whole`'s dtype, then `tail` (the check column)."""
    n = unit.world_size
    zero = tail.new_zeros(())  # no gradient (frozen): zeros, not allocated per parameter
    dtypes = {g.dtype for g in grads if g is not None}
    if _chunk_cat is not None and dtypes <= {tail.dtype}:  # one kernel where all are contiguous
        flats = [zero.expand(p.numel) if g is None else g.reshape(-1) for p, g in zip(unit.params, grads)]
        _chunk_cat([*flats, tail.view(-1)], 0, n, out=whole)
        return
    blocks = [zero.expand(n, p.shard_numel) if b is None else b for p, b in zip(unit.params, grad_blocks(unit, grads))]
    torch.cat([*blocks, tail], dim=1, out=whole)  # casts to whole's dtype


@dataclass(eq=False)
class PendingReduce:
    """A reduction in flight; `whole` is kept until the wait (Note: gradient copy-in)."""

    unit: Unit
    work: Any  # None: nothing to wait for (one rank)
    out: torch.Tensor
    whole: torch.Tensor
    present: list[bool] = field(default_factory=list)  # which parameters had a gradient
    done: object = None  # event after the last queued operation (CUDA), else None
    stamped: bool = False  # whether the rank checks stamped its column (checks.py)
    replicated: bool = False  # whether its All-Reduce across shard groups went out


class Reductions:
    """Reduce-Scatters in flight, oldest first; at most `in_flight` stay pending."""

    def __init__(self, *, in_flight: int, offload: ShardSource | None = None, pool: BufferPool | None = None) -> None:
        self.in_flight = in_flight
        self.offload = offload  # reduced shard gradients go to the host instead of `.grad`
        self.pool = pool  # with streams (CUDA): its Reduce-Scatter inputs emptied when a backward ends
        self._pending: deque[PendingReduce] = deque()

    def start(self, unit: Unit, grads: list[torch.Tensor | None] | Summed) -> None:
        """Start reducing `unit`'s whole gradients (None: frozen) or their sum with sync off."""
        with torch.profiler.record_function(f"ZeRO3::reduce_grads({unit.name})"):
            if not isinstance(grads, Summed):
                grads = [g if p.requires_grad else None for g, p in zip(grads, unit.params)]
            self._pending.append(self._start(unit, grads))
            while len(self._pending) > self.in_flight:
                self._finish_oldest()

    def finish_all(self) -> None:
        while self._pending:
            self._finish_oldest()
        if self.offload is not None:
            self.offload.settle()
        if self.pool is not None:  # for the forward's activations (buffers.py, Note: what the pool keeps)
            self.pool.empty(role="reduce")

    def drop_all(self) -> None:
        """A backward raised (hooks.py, Note: exceptions): complete the collectives, drop their gradients."""
        while self._pending:
            self._finish(self._pending.popleft())
        if self.offload is not None:
            self.offload.drop()

    def _finish_oldest(self) -> None:
        pending = self._pending.popleft()
        with torch.profiler.record_function(f"ZeRO3::wait_reduce({pending.unit.name})"):
            shard_grads = self._finish(pending)
        if self.offload is not None:
            self.offload.download(pending.unit, shard_grads)  # into `.grad` at `finish_all`
            return
        for sharded, grad in zip(pending.unit.params, shard_grads):
            if grad is None:
                continue
            if sharded.param.grad is None:
                sharded.param.grad = grad  # a view of the unit's reduced buffer: no copy
            else:
                sharded.param.grad.add_(grad)

    def _start(self, unit: Unit, grads: list[torch.Tensor | None] | Summed) -> PendingReduce:
        device = unit.device
        n, width, s = unit.world_size, unit.reduce_row_numel, unit.shard_numel
        self._advance()  # older reductions' All-Reduces go out first, in order
        streams = unit.comm.streams(device)
        out = torch.empty(width, dtype=unit.reduce_dtype, device=device)
        with torch.no_grad():  # the copy-in, on the compute stream (Note: gradient copy-in)
            whole = unit.pool.take("reduce", n * width, unit.reduce_dtype, device).view(n, width)  # (N, row)
            tail, stamped = unit.checks.reduce_tail(unit.uid, unit.comm.rank, (n, width - s), unit.code_dtype, device)
            if isinstance(grads, Summed):
                whole[:, :s].copy_(grads.total)  # casts to reduce_dtype
                whole[:, s:].copy_(tail)
            else:
                pack_gradients(unit, grads, whole, tail)
        with streams.on("reduce"):  # waits for the copy-in
            what = f"gradients of unit '{unit.name}'"
            work = unit.comm.reduce_scatter(out, whole, what=what, async_op=True, quantize_data=s)
            done = streams.event()
        present = grads.present if isinstance(grads, Summed) else [g is not None for g in grads]
        pending = PendingReduce(unit=unit, work=work, out=out, whole=whole, present=present, done=done, stamped=stamped)
        if unit.replicate is not None and streams.enabled:
            _replicate(pending)  # stream-ordered: no host wait
        return pending

    def _advance(self) -> None:
        """Issue the All-Reduces across shard groups not issued yet, oldest first."""
        for pending in self._pending:
            if pending.unit.replicate is not None and not pending.replicated:
                _replicate(pending)

    def _finish(self, pending: PendingReduce) -> list[torch.Tensor | None]:
        """Wait for the reduction; this rank's averaged shard gradients in the shard dtype (views
        of one buffer), None where no gradient was given."""
        unit = pending.unit
        n, s = unit.world_size, unit.shard_numel
        summed = pending.out[:s]
        # Allocated here, on the compute stream that uses it (Note: gradient copy-in).
        out = summed if summed.dtype == unit.shard_dtype else torch.empty_like(summed, dtype=unit.shard_dtype)
        if unit.replicate is not None:
            if not pending.replicated:  # the oldest: every older one is finished
                _replicate(pending)
            n *= unit.replicate.world_size
            _wait(pending, "All-Reduce", "replicate", average=(n, out))
        else:
            _wait(pending, "Reduce-Scatter", "reduce", average=(n, out))
        unit.comm.streams(pending.out.device).wait_for(pending.done)
        unit.pool.give("reduce", pending.whole.view(-1))
        present = pending.present
        return [out[o : o + p.shard_numel] if has else None for p, o, has in zip(unit.params, unit.offsets, present)]


def _wait(
    pending: PendingReduce, collective: str, stream: str | None, average: tuple[int, torch.Tensor] | None = None
) -> None:
    """Wait for `pending`'s collective (on `stream`, None: the current one); record its check
    column. `average` (N, out): then, on that stream, the sum / N into `out` (Note: gradient copy-in)."""
    unit = pending.unit
    streams = unit.comm.streams(pending.out.device)
    what = f"gradients of unit '{unit.name}'" + (" across shard groups" if collective == "All-Reduce" else "")
    try:
        with streams.on(stream, wait_current=False):
            streams.wait_for(pending.done)
            if pending.work is not None:
                pending.work.wait()
            received = pending.out[unit.shard_numel :][:1].to(torch.int64) if pending.stamped else None
            if average is not None:  # sum over all ranks / N: the same average DDP takes
                n, out = average
                torch.div(pending.out[: unit.shard_numel], n, out=out)  # casts to the shard dtype
            pending.done = done = streams.event()
    except RuntimeError as err:
        unit.checks.raise_pending_mismatch()
        raise unit.comm.failed(collective, what, err) from err
    if received is not None:  # read on the compute stream: after `done` when made on another
        ready = None if stream is None or done is None else lambda: streams.wait_for(done)
        unit.checks.read_reduce(collective, unit.name, received, unit.uid, unit.code_dtype, ready=ready)


def _replicate(pending: PendingReduce) -> None:
    """With shard groups: All-Reduce this rank's piece with the other groups', after the scatter."""
    unit = pending.unit
    assert unit.replicate is not None
    pending.replicated = True
    _wait(pending, "Reduce-Scatter", "replicate")  # on its stream: the reduce stream goes on to the next unit
    streams, s = unit.comm.streams(pending.out.device), unit.shard_numel
    with streams.on("replicate", after=pending.done, wait_current=False):  # not behind the compute
        what = f"gradients of unit '{unit.name}' across shard groups"
        pending.work = unit.replicate.all_reduce(pending.out, what=what, async_op=True, quantize_data=s)
        pending.done = streams.event()
