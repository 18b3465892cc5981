"""`Unit`: the parameters gathered by one collective: gather, release, its pending gather.
Reducing its gradients is reduce.py's.

[Note: flat layout]
Each rank sends one row: its shards of the unit's parameters back to back (shard i at offset o_i, S
elements in all), the check slot (checks.py), zeros up to a multiple of 16 bytes (NCCL is fastest with
aligned chunks). (docs/design.md, flat layout)

[Note: dtypes]
Shards (the optimizer's master copy) keep the model's dtype; gathers and compute use
`param_dtype`; reductions `reduce_dtype` (default fp32, or the shard dtype when wider).

[Note: whole-parameter blocks]
One gather's whole parameters are views of one pooled block of N * S elements, parameter i at
N * o_i, filled by one `split_with_sizes_copy`. Autograd keeps them from forward to backward, so
`release` moves the block's memory out of their storage into the pool, and the re-gather moves a
pooled block back in (`UntypedStorage._swap_data_ptr_`, private; tried on torch 2.13). FSDP2's
`resize_(0)` / `resize_(n)` cost 1.3-4.2% more CPU and 6x the page faults (docs/performance.md),
and a pooled block carries its last stream's event (buffers.py), a freed storage none.

[Note: one kernel per copy]
On CUDA a copy op over many tensors runs as one kernel only in some forms; otherwise it launches
one per tensor. `split_with_sizes_copy`: a dense input and dense outputs of its dtype (so the
copy-out splits whole rows, the check slot and padding into a scratch tensor); `cat`: contiguous
inputs of the output's dtype (so no cast inside it); `_chunk_cat`: contiguous inputs of one dtype
into a dense output of that dtype or bf16 -> fp32 (the Reduce-Scatter copy-in: it pads and casts
each gradient and appends the check column, reduce.py); `_foreach_copy_`: pairs of equal layout,
casting (the gather copy-in of shards moved off their buffer; one `copy_` while they lie in it).
FSDP2 packs with the same ops. `torch._chunk_cat` and
`torch._foreach_copy_` are private (FSDP2's copy-ins; tried on torch 2.13); where one is missing
`torch.cat` does the same work, a kernel per tensor when it casts. tests/engine/test_cuda_standin.py
asserts these forms on the path CUDA takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Protocol

import torch
from torch import nn

from lightning_zero3.engine.checks import OrderMismatchError, RankChecks, exact_integers, read_tags, tag_numel
from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.quantize import KeptPacked
from lightning_zero3.engine.record import StepRecord
from lightning_zero3.engine.shard import ShardedParam, one_row, shard_writes

__all__ = ["ALIGN_BYTES", "ShardSource", "Unit", "aligned_numel"]

_foreach_copy = getattr(torch, "_foreach_copy_", None)  # private: Note: one kernel per copy

ALIGN_BYTES = 16  # Note: flat layout


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """`numel` rounded up to fill a multiple of ALIGN_BYTES."""
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-numel // per) * per


class ShardSource(Protocol):
    """Where gathers read shards that live off the compute device, and reductions put their
    gradients (offload.py, one `HostOffload`)."""

    device: torch.device

    def fill(self, unit: Unit, out: torch.Tensor, *, exact: bool) -> None: ...
    def begin_pass(self) -> None: ...
    def download(self, unit: Unit, grads: list[torch.Tensor | None]) -> None: ...
    def settle(self) -> None: ...
    def drop(self) -> None: ...


@dataclass
class _PendingGather:
    """An All-Gather in flight, or finished but not read; `recv` goes back to the pool only after
    the wait: the collective writes it on its own stream after `start_gather` returns."""

    work: Any
    recv: torch.Tensor  # in the dtype asked for
    issued: Any  # event after the issue (CUDA), else None
    tag: int  # the tag this rank stamped
    stamped: bool  # whether the step's rank checks stamped it (checks.py)
    comm: Comm  # the shard group, or the group of G holding slices (reshard.py)
    data: int  # elements of each row before its check slot


class Unit:
    """The parameters of one module subtree that are gathered and reduced together."""

    def __init__(
        self,
        *,
        uid: int,
        name: str,
        module: nn.Module,
        params: list[ShardedParam],
        comm: Comm,
        checks: RankChecks,
        replicate: Comm | None,
        slice_comm: Comm | None,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        record: StepRecord,
        offload: ShardSource | None,
    ) -> None:
        dtypes = {p.param.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"Unit '{name}' holds parameters of several dtypes {sorted(map(str, dtypes))}; a unit is "
                f"gathered as one buffer. Cast the model to one dtype before sharding, or give the "
                f"modules of each dtype their own unit through wrap_policy."
            )
        self.uid = uid
        self.name = name
        self.module = module
        self.params = params
        self.comm = comm
        self.checks = checks  # stamps and reads the check slots (checks.py)
        self.pool = comm.pool  # every group's buffers come from the model's one pool
        self.replicate = replicate  # hierarchical sharding: the same shards in the other groups
        self.record = record
        shard_dtype = params[0].param.dtype if params else torch.float32
        self.shard_dtype = shard_dtype
        self.param_dtype = param_dtype or shard_dtype
        self.reduce_dtype = reduce_dtype or (shard_dtype if shard_dtype.itemsize >= 4 else torch.float32)
        # The check column travels with the gradients (`param_dtype`) into the reduce input: its
        # codes must be exact in both (checks.py, Note: check slot).
        self.code_dtype = min(self.param_dtype, self.reduce_dtype, key=exact_integers)
        numels = [p.shard_numel for p in params]
        self.offsets = [0, *accumulate(numels)][:-1]  # o_i (Note: flat layout)
        self.shard_numel = sum(numels)  # S
        self.reduce_row_numel = aligned_numel(self.shard_numel + 1, self.reduce_dtype)
        self._pending: _PendingGather | None = None
        # reshard_after_forward=G: the group of G and the slice kept after forward, with the shard
        # versions it was cut at (reshard.py).
        self.slice_comm = slice_comm
        self._slice: tuple[torch.Tensor, tuple[int, ...]] | None = None
        self.offload = offload  # where the shards live off the device (offload.py), else None
        self._packed = KeptPacked()  # quantize_weights: this rank's codes and scales (quantize.py)

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, params={len(self.params)}, shard_numel={self.shard_numel})"

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def device(self) -> torch.device:  # the compute device
        return self.offload.device if self.offload is not None else self.params[0].param.device

    @property
    def gather_in_flight(self) -> bool:
        return self._pending is not None

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def block_numel(self) -> int:  # Note: whole-parameter blocks
        return self.world_size * self.shard_numel

    def row_numel(self, dtype: torch.dtype | None = None, *, per: int = 1) -> int:
        """An All-Gather row in `dtype` (default `param_dtype`) holding `per` shards of each
        parameter (a slice of a group of G holds N/G)."""
        dtype = dtype or self.param_dtype
        return aligned_numel(per * self.shard_numel + tag_numel(dtype), dtype)

    def versions(self) -> tuple[int, ...]:
        return tuple(p.param._version for p in self.params)

    def shard_state(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """What the shards' values depend on, as far as can be seen (quantize.py, Note: packed once per change)."""
        return shard_writes(), tuple((p.param._version, p.param.data_ptr()) for p in self.params)

    # ---- gather ---------------------------------------------------------------------------
    def start_gather(self, dtype: torch.dtype | None = None, *, tag: int | None = None) -> None:
        """Issue the All-Gather, in `dtype` (default `param_dtype`), unless one is pending. `tag`
        replaces the unit's own (a departure notice)."""
        if self._pending is not None or not self.params:
            return
        exact = dtype is not None  # a caller's dtype asks for the shards' own values (offload.py)
        dtype = dtype or self.param_dtype
        tag = self.checks.tag(self.uid) if tag is None else tag
        device = self.device
        kept = self._slice
        if kept is not None and (kept[0].dtype != dtype or kept[1] != self.versions()):
            self.drop_slice()  # stale (an optimizer step since) or another dtype asked for
            kept = None
        comm = self.comm if kept is None else self.slice_comm
        assert comm is not None
        per = self.world_size // comm.world_size  # a slice holds N/G shards of each parameter
        s, width = per * self.shard_numel, self.row_numel(dtype, per=per)
        streams = comm.streams(device)
        with streams.on("copy_in"), torch.no_grad():
            recv = self.pool.take("gather", comm.world_size * width, dtype, device)
            mine = recv[comm.rank * width : (comm.rank + 1) * width]  # the send row
            if kept is None and self.offload is not None:
                self.offload.fill(self, mine[:s], exact=exact)
            elif kept is None:
                self._pack_shards(mine[:s])
            else:
                mine[:s].copy_(kept[0])
                self.drop_slice()  # used: freed (reshard.py)
            stamped = self.checks.stamp_gather(mine[s : s + tag_numel(dtype)], tag)
            copied = streams.event()
        with streams.on("gather", after=copied):
            quantize = None if exact else s  # compute weights may travel quantized, master values never
            packed = None if exact else (self._packed, self.shard_state())
            work = comm.all_gather(
                recv, mine, async_op=True, what=f"unit '{self.name}'", quantize_data=quantize, kept=packed
            )
            issued = streams.event()
        self._pending = _PendingGather(work, recv, issued, tag, stamped, comm, s)
        self.record.add("gathered" if kept is None else "gathered_slice", self.uid)
        if stamped:
            self.checks.in_flight[self.uid] = self._settle_if_arrived

    def _settle_if_arrived(self) -> None:
        """checks.py, Note: deferred tag checks: record the tags of a completed gather, never wait."""
        pending = self._pending
        if pending is None or (pending.work is not None and not pending.work.is_completed()):
            return
        try:
            gathered = self._wait_gather()
        except OrderMismatchError:
            raise  # the cause, found by the check inside
        except RuntimeError:
            return  # it failed too: the check that follows reports what the others brought
        self.pool.give("gather", gathered.view(-1))

    def discard_gather(self) -> None:
        """Drop an unused prefetch (the collective still completes)."""
        if self._pending is not None:
            self.pool.give("gather", self._wait_gather().view(-1))

    def _finish_gather(self) -> tuple[torch.Tensor, _PendingGather]:
        pending = self._pending
        assert pending is not None
        self._pending = None
        self.checks.in_flight.pop(self.uid, None)
        comm = pending.comm
        try:
            comm.streams(pending.recv.device).wait_for(pending.issued)
            comm.wait(pending.work, pending.recv.device)
        except RuntimeError as err:
            self.checks.raise_pending_mismatch()
            raise comm.failed("All-Gather", f"unit '{self.name}'", err) from err
        return pending.recv.view(comm.world_size, -1), pending

    @staticmethod
    def _slots(gathered: torch.Tensor, pending: _PendingGather) -> torch.Tensor:  # Note: check slot
        return gathered[:, pending.data : pending.data + tag_numel(gathered.dtype)]

    def _wait_gather(self) -> torch.Tensor:
        """The (N, row) buffer of the pending All-Gather (give it back to the pool), its tags recorded."""
        gathered, pending = self._finish_gather()
        if pending.stamped:
            self.checks.read_gather(self.name, self._slots(gathered, pending), pending.tag)
        return gathered

    def announce(self, tag: int) -> list[int]:
        """Join this unit's All-Gather carrying `tag` (departure.py); every rank's tag, read at once."""
        self.start_gather(tag=tag)
        gathered, pending = self._finish_gather()
        tags = read_tags(self._slots(gathered, pending)).tolist()  # a sync, only when leaving the record
        self.pool.give("gather", gathered.view(-1))
        return tags

    def gather(self, into: list[torch.Tensor] | None = None, *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Whole parameters in `dtype` (default `param_dtype`; `shard_dtype` for the exact master
        values). With `into` (tensors `release` emptied), refill their storage without bumping
        their version (Note: whole-parameter blocks)."""
        asked, dtype = dtype, dtype or self.param_dtype
        if self._pending is not None and self._pending.recv.dtype != dtype:
            self.discard_gather()
        self.start_gather(asked)
        gathered = self._wait_gather()
        n = self.world_size
        if into is None:
            block = self.pool.take("block", self.block_numel, gathered.dtype, gathered.device)
            wholes = [block[n * o : n * o + p.numel].view(p.whole_shape) for p, o in zip(self.params, self.offsets)]
        else:
            storage = into[0].untyped_storage()
            if storage.size() == 0:
                refill = self.pool.take("block", self.block_numel, into[0].dtype, storage.device)
                storage._swap_data_ptr_(refill.untyped_storage())  # type: ignore[attr-defined]  # private: Note
            block = self._block(storage, into[0])
            wholes = list(into)
        self._unpack_rows(gathered, block)
        self.pool.give("gather", gathered.view(-1))
        return wholes

    # ---- packing (Note: one kernel per copy) ------------------------------------------------
    def _pack_shards(self, send: torch.Tensor) -> None:
        """This rank's shards back to back into `send` (S elements, any dtype: cast on the way):
        one copy from their buffer while they lie in it (shard.py, Note: shards in one buffer)."""
        shards = [p.param.detach() for p in self.params]
        row = one_row(shards, self.offsets, self.shard_numel)
        with torch.no_grad():
            if row is not None:
                send.copy_(row)
            elif _foreach_copy is None:
                torch.cat(shards, out=send)
            else:  # moved off their buffer (e.g. `param.data = ...`)
                _foreach_copy(list(send.split([p.shard_numel for p in self.params])), shards)

    def _unpack_rows(self, gathered: torch.Tensor, block: torch.Tensor) -> None:
        """The gathered (rows, row) buffer into `block`: row r's shards of parameter i go to
        n * o_i + r * size_i (Note: whole-parameter blocks)."""
        n, rows, width = self.world_size, gathered.shape[0], gathered.shape[1]
        per = n // rows  # shards of each parameter per row: 1, or N/G from slices
        sizes = [per * p.shard_numel for p in self.params]
        out = [block[n * o : n * o + rows * s].view(rows, s) for o, s in zip(self.offsets, sizes)]
        rest = width - per * self.shard_numel  # the check slot and padding: split off, then dropped
        with torch.no_grad():
            scratch = torch.empty(rows, rest, dtype=gathered.dtype, device=gathered.device)
            torch.split_with_sizes_copy(gathered, [*sizes, rest], dim=1, out=[*out, scratch])

    def gather_into(self, outputs: list[torch.Tensor], *, dtype: torch.dtype | None = None) -> None:
        """Gather into `outputs` (whole shapes, any device); the block goes back to the pool.

        [Note: copies to the host]
        Host outputs of a unit gathered on a device with streams (full state dicts, restoring to
        the host) come through one staging row, pinned on a GPU: one non-blocking copy of the
        block, one host wait on its event, then host copies; a blocking copy per parameter would
        make the host wait once per parameter."""
        wholes = self.gather(dtype=dtype)
        sources, streams = wholes, self.comm.streams(wholes[0].device)
        with torch.no_grad():
            if streams.enabled and outputs[0].device.type == "cpu":
                block = self._block(wholes[0].untyped_storage(), wholes[0])
                staging = torch.empty(block.numel(), dtype=block.dtype, pin_memory=block.device.type == "cuda")
                staging.copy_(block, non_blocking=True)
                streams.event().synchronize()
                n, pairs = self.world_size, zip(self.params, self.offsets)
                sources = [staging[n * o : n * o + p.numel].view(p.whole_shape) for p, o in pairs]
            for out, whole in zip(outputs, sources):
                out.copy_(whole)
        self.release(wholes)

    def release(self, wholes: list[torch.Tensor]) -> None:
        """Empty the storage of `gather`'s tensors, keeping the objects autograd may have saved;
        the memory goes to the pool (Note: whole-parameter blocks)."""
        if not wholes:
            return
        storage = wholes[0].untyped_storage()  # all whole parameters of a gather share it
        if storage.size() == 0:
            return
        holder = torch.empty(0, dtype=wholes[0].dtype, device=wholes[0].device).untyped_storage()
        holder._swap_data_ptr_(storage)  # type: ignore[attr-defined]  # `storage` is left empty
        self.pool.give("block", self._block(holder, wholes[0]))

    def _block(self, storage: Any, like: torch.Tensor) -> torch.Tensor:
        """A new 1-D tensor over `storage`: writes through it leave the version counters of the
        tensors already on it alone."""
        return torch.empty(0, dtype=like.dtype, device=like.device).set_(storage, 0, (self.block_numel,), (1,))

    # ---- the slice kept after forward (reshard.py) ----------------------------------------
    def keep_slice(self, wholes: list[torch.Tensor]) -> None:
        """Copy this rank's 1/G slice out of `gather`'s `wholes` (Note: flat layout)."""
        comm = self.slice_comm
        assert comm is not None and wholes
        self.drop_slice()
        n, per, j = self.world_size, self.world_size // comm.world_size, comm.rank
        block = self._block(wholes[0].untyped_storage(), wholes[0])
        spans = [(n * o + j * per * p.shard_numel, per * p.shard_numel) for p, o in zip(self.params, self.offsets)]
        streams = comm.streams(block.device)
        with streams.on("copy_in"), torch.no_grad():
            kept = self.pool.take("slice", per * self.shard_numel, block.dtype, block.device)
            torch.cat([block[start : start + size] for start, size in spans], out=kept)
            copied = streams.event()
        streams.wait_for(copied)  # the block goes back to the pool next, on the compute stream
        self._slice = (kept, self.versions())
        self.record.add("kept_slice", self.uid)

    def drop_slice(self) -> None:
        if self._slice is not None and self.slice_comm is not None:
            with self.slice_comm.streams(self._slice[0].device).on("copy_in"):
                self.pool.give("slice", self._slice[0])
        self._slice = None
