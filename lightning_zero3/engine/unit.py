"""`Unit`: the parameters gathered by one collective, and the three things done to them:
gather (All-Gather shards -> full tensors), release, and start_reduce/finish_reduce (Reduce-Scatter full
gradients -> averaged shard gradients).

[Note: flat layout and unit tag]
Each rank sends one flat buffer: its shards of the unit's parameters back to back (shard i at
offset o_i, `shard_numel_i` long), then the unit's tag (its id + 1) stored as the 32 bits of an
int32 in `tag_numel` elements (one element of 32 bits or more, two of a 16-bit dtype). The
gathered buffer is (world_size, S + tag_numel), rank-major; parameter i's full flat data is
column block [o_i, o_i + shard_numel_i) read row by row, cut to `numel_i`. The Reduce-Scatter input
is (world_size, S + 1) with the same column layout, so each rank receives exactly the summed
gradient of its own shards, and its last column, holding the tag as a number, sums to
world_size * tag. Checking the tag on arrival turns "ranks gathered different units of the same
size" from silently mixed parameters into an error that names both units.

[Note: dtypes]
Shards (the optimizer's master copy) keep the model's dtype. Gathers run in `param_dtype`
(e.g. bf16: half the bytes of fp32), so the full parameters and the compute are in it.
Gradients arrive in `param_dtype` and are reduced in `reduce_dtype` (default: fp32, or the
shard dtype when wider), then cast to the shard dtype. A 16-bit reduction cannot hold large
integers exactly, so there the tag column carries 1 and only counts the ranks.

[Note: full-parameter blocks]
The full parameters of one gather are views of one block of `numel` elements taken from the
unit's `BufferPool`. Autograd keeps those tensors (or views of them) from forward to backward,
so `release` cannot drop them: it moves the block's memory out of their storage and back into
the pool (`UntypedStorage._swap_data_ptr_`), leaving the storage empty, and the backward's
re-gather moves a pooled block in again. The few blocks the pool holds are then reused step
after step: no allocation, no page faults on fresh memory and no heap fragmentation from full
parameters, although autograd holds every unit's (empty) tensors until its backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_zero3.engine.buffers import BufferPool
from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.shard import ShardedParam

# Moving a block of memory between two storages (Note: full-parameter blocks); older torch
# releases without it free and re-allocate instead.
_SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class OrderMismatchError(RuntimeError):
    """Ranks ran different units at the same point of a step."""


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
        unit_name: Callable[[int], str],
        replicate: Comm | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        pool: BufferPool | None = None,
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
        # Send, receive and reduction buffers come from here and go back after each use.
        self.pool = pool or BufferPool()
        # Hierarchical sharding: the ranks holding the same shards in the other shard groups.
        self.replicate = replicate
        # Maps a tag read off the wire back to a unit name, for error messages.
        self._unit_name = unit_name
        self.tag = uid + 1
        shard_dtype = params[0].param.dtype if params else torch.float32
        self.shard_dtype = shard_dtype
        self.param_dtype = param_dtype or shard_dtype
        wide = shard_dtype if shard_dtype.itemsize >= 4 else torch.float32
        self.reduce_dtype = reduce_dtype or wide
        self.tag_numel = self._tag_numel(self.param_dtype)
        # What the Reduce-Scatter's tag column must sum to per rank (see Note: dtypes).
        self._reduce_tag = float(self.tag) if self.reduce_dtype.itemsize >= 4 else 1.0
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.shard_numel
        # Elements each rank contributes, without the tag.
        self.shard_numel = total
        # In-flight or finished-but-unread All-Gather: (work, gathered buffer, its dtype). The
        # buffer goes back to the pool only after the wait: with NCCL the collective uses it on
        # its own stream after `start_gather` returns.
        self._pending: tuple[object, torch.Tensor, torch.dtype] | None = None

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, params={len(self.params)}, shard_numel={self.shard_numel})"

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def gather_in_flight(self) -> bool:
        return self._pending is not None

    @property
    def numel(self) -> int:
        """Full (unpadded) elements of all parameters of the unit."""
        return sum(p.numel for p in self.params)

    def _like(self) -> torch.Tensor:
        return self.params[0].param

    # ---- gather ---------------------------------------------------------------------------
    @staticmethod
    def _tag_numel(dtype: torch.dtype) -> int:
        return max(1, 4 // dtype.itemsize)  # elements that hold 32 bits

    def start_gather(self, dtype: torch.dtype | None = None) -> None:
        """Issue the All-Gather asynchronously (prefetch), in `dtype` (default `param_dtype`).
        No-op if one is already pending."""
        if self._pending is not None or not self.params:
            return
        dtype = dtype or self.param_dtype
        like = self._like()
        width = self.shard_numel + self._tag_numel(dtype)
        recv = self.pool.take(self.world_size * width, dtype, like.device)
        # This rank's row of the output is its send buffer (an in-place All-Gather).
        send = recv[self.comm.rank * width : (self.comm.rank + 1) * width]
        with torch.no_grad():
            if dtype == like.dtype:
                torch.cat([p.param.detach() for p in self.params], out=send[: self.shard_numel])
            else:
                for p, offset in zip(self.params, self.offsets):
                    send[offset : offset + p.shard_numel].copy_(p.param.detach())  # casts
            bits = torch.tensor([self.tag], dtype=torch.int32).view(dtype)  # the tag's 32 bits, as `dtype`
            send[self.shard_numel :].copy_(bits[: send.numel() - self.shard_numel])
        work = self.comm.all_gather(recv, send, async_op=True, what=f"unit '{self.name}'")
        self._pending = (work, recv, dtype)

    def discard_gather(self) -> None:
        """Drop a prefetch that the step did not use (the collective still completes)."""
        if self._pending is not None:
            work, recv, _ = self._pending
            self.comm.wait(work)
            self._pending = None
            self.pool.give(recv)

    def _take_gathered(self, dtype: torch.dtype) -> torch.Tensor:
        """The gathered (N, S + tag) buffer; give it back to the pool when done with it."""
        if self._pending is not None and self._pending[2] != dtype:
            self.discard_gather()
        if self._pending is None:
            self.start_gather(dtype)
        assert self._pending is not None
        work, recv, _ = self._pending
        self._pending = None
        try:
            self.comm.wait(work)
        except RuntimeError as err:
            raise self.comm.failed("All-Gather", f"unit '{self.name}'", err) from err
        gathered = recv.view(self.world_size, self.shard_numel + self._tag_numel(dtype))  # (N, S + tag)
        tags = gathered[:, self.shard_numel :].contiguous().view(torch.int32)[:, 0]  # (N,)
        if not bool((tags == self.tag).all()):
            self._raise_mismatch("All-Gather", [int(t) for t in tags])
        return gathered

    def _raise_mismatch(self, collective: str, tags: list[int]) -> None:
        seen = ", ".join(f"rank {r}: '{self._unit_name(t - 1)}'" for r, t in enumerate(tags))
        raise OrderMismatchError(
            f"{collective} mismatch on rank {self.comm.rank}: this rank expected unit '{self.name}' but "
            f"the ranks were at [{seen}]. Every rank must run the same units in the same order each "
            f"step; data-dependent control flow (a block skipped on some ranks) is not supported "
            f"under ZeRO-3. Make the branch decision identical on all ranks."
        )

    def gather(self, into: list[torch.Tensor] | None = None, *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Full parameters of the unit, in `dtype` (default `param_dtype`; pass `shard_dtype`
        for the exact master values). With `into` (full tensors that `release` emptied), refill
        those tensors' storage in place instead of allocating new tensors, without bumping their
        version (Note: full-parameter blocks)."""
        gathered = self._take_gathered(dtype or self.param_dtype)
        if into is None:
            base = self.pool.take(self.numel, gathered.dtype, gathered.device)
            fulls = []
            start = 0
            for p in self.params:
                fulls.append(base[start : start + p.numel].view(p.full_shape))
                start += p.numel
        else:
            storage = into[0].untyped_storage()
            if storage.size() == 0:
                self._refill(storage, into[0].dtype)
            fulls = list(into)
        for i, p in enumerate(self.params):
            flat = fulls[i].data.view(-1)  # `.data` does not share the autograd version counter
            s, o = p.shard_numel, self.offsets[i]
            rows = p.numel // s  # ranks whose piece is entirely real data
            with torch.no_grad():
                flat[: rows * s].view(rows, s).copy_(gathered[:rows, o : o + s])
                rest = p.numel - rows * s
                if rest:
                    flat[rows * s :].copy_(gathered[rows, o : o + rest])
        self.pool.give(gathered.view(-1))
        return fulls

    def _refill(self, storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
        """Give an emptied full-parameter storage a block of memory again."""
        if _SWAP_STORAGE:
            block = self.pool.take(self.numel, dtype, storage.device)
            storage._swap_data_ptr_(block.untyped_storage())  # the block's memory moves into `storage`
        else:
            storage.resize_(self.numel * dtype.itemsize)

    def release(self, fulls: list[torch.Tensor]) -> None:
        """Empty the storage of full parameters from `gather` while keeping the tensor objects,
        which autograd may have saved; `gather(into=fulls)` refills it. The memory goes back to
        the pool (Note: full-parameter blocks)."""
        if not fulls:
            return
        storage = fulls[0].untyped_storage()  # all full parameters of a gather share it
        if storage.size() == 0:
            return
        if _SWAP_STORAGE and storage.size() == self.numel * fulls[0].element_size():
            holder = torch.empty(0, dtype=fulls[0].dtype, device=fulls[0].device)
            holder.untyped_storage()._swap_data_ptr_(storage)  # `storage` is left empty
            self.pool.give(holder.set_(holder.untyped_storage(), 0, (self.numel,)))
        else:
            storage.resize_(0)

    # ---- reduce ---------------------------------------------------------------------------
    def start_reduce(self, grads: list[torch.Tensor | None]) -> PendingReduce:
        """Issue the Reduce-Scatter of full gradients asynchronously (None: no gradient, sent as
        zeros); `finish_reduce` waits and returns the shard gradients."""
        like = self._like()
        n, width = self.world_size, self.shard_numel + 1
        full = self.pool.take(n * width, self.reduce_dtype, like.device).view(n, width)  # (N, S + 1)
        with torch.no_grad():
            for i, (p, grad) in enumerate(zip(self.params, grads)):
                s, o = p.shard_numel, self.offsets[i]
                block = full[:, o : o + s]
                if grad is None:
                    block.zero_()
                    continue
                flat = grad.reshape(-1)
                rows = p.numel // s
                block[:rows].copy_(flat[: rows * s].view(rows, s))  # casts to reduce_dtype
                rest = p.numel - rows * s
                if rows < n:
                    block[rows:].zero_()
                    if rest:
                        block[rows, :rest].copy_(flat[rows * s :])
            full[:, self.shard_numel] = self._reduce_tag
        out = torch.empty(width, dtype=self.reduce_dtype, device=like.device)
        work = self.comm.reduce_scatter(out, full, what=f"gradients of unit '{self.name}'", async_op=True)
        return PendingReduce(work=work, out=out, full=full, present=[g is not None for g in grads])

    def finish_reduce(self, pending: PendingReduce) -> list[torch.Tensor | None]:
        """Wait for `start_reduce`'s collective; return this rank's averaged shard gradients in
        the shard dtype (views of one flat buffer), None where no gradient was given."""
        try:
            if pending.work is not None:
                pending.work.wait()
        except RuntimeError as err:
            raise self.comm.failed("Reduce-Scatter", f"gradients of unit '{self.name}'", err) from err
        self.pool.give(pending.full.view(-1))
        out, n = pending.out, self.world_size
        if self.replicate is not None:
            # Only this rank's 1/G of the gradient crosses to the other groups.
            self.replicate.all_reduce(out, what=f"gradients of unit '{self.name}' across shard groups")
            n *= self.replicate.world_size
        tag_sum = float(out[self.shard_numel])
        if tag_sum != self._reduce_tag * n:
            raise OrderMismatchError(
                f"Reduce-Scatter mismatch on rank {self.comm.rank}: this rank reduced unit '{self.name}' "
                f"but the other ranks reduced a different unit of the same size (tag sum {tag_sum:g}, "
                f"expected {self._reduce_tag * n:g}). Every rank must use the same units in the loss each "
                f"step; a unit whose output reaches the loss on some ranks only is not supported."
            )
        out = out[: self.shard_numel]
        out.div_(n)  # sum over all ranks / N: the same average DDP takes
        if out.dtype != self.shard_dtype:
            out = out.to(self.shard_dtype)
        return [
            out[o : o + p.shard_numel] if present else None
            for p, o, present in zip(self.params, self.offsets, pending.present)
        ]

@dataclass
class PendingReduce:
    """A Reduce-Scatter in flight. `full` is kept until the wait (NCCL reads it on its stream)."""

    work: object
    out: torch.Tensor
    full: torch.Tensor
    present: list[bool]
