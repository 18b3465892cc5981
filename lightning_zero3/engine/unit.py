"""`Unit`: the parameters gathered by one collective, and the three things done to them:
gather (All-Gather shards -> full tensors), release, and start_reduce/finish_reduce (Reduce-Scatter full
gradients -> averaged shard gradients; done by reduce.py).

[Note: flat layout and unit tag]
Each rank sends one flat row: its shards of the unit's parameters back to back (shard i at
offset o_i, `shard_numel_i` long, S in all), then the unit's tag (its id + 1) stored as the 32
bits of an int32 in `tag_numel` elements (one element of 32 bits or more, two of a 16-bit
dtype), then zeros up to a multiple of 16 bytes (`row_numel`): NCCL's collectives are fastest
when each rank's chunk starts 16-byte aligned. The gathered buffer is (world_size, row),
rank-major; parameter i's full flat data is column block [o_i, o_i + shard_numel_i) read row by
row, cut to `numel_i`. The Reduce-Scatter input is (world_size, reduce row) with the same column
layout and one tag column at S (then alignment zeros), so each rank receives exactly the summed
gradient of its own shards. In the tag column each rank writes its unit's code into the row of
the next rank of its group and zeros elsewhere, so each rank receives its neighbour's code,
exactly, in any dtype and at any world size (a sum of one number and zeros). Checking the
tags (tags.py, Note: deferred tag checks) turns "ranks gathered or reduced different units of
the same size" from silently mixed parameters into an error that names the units.
A rank's shards live in such a row between gathers (shard.py, Note: shards in one row): a
gather in the shards' dtype sends that row itself, and this rank's part of the full parameters
is copied from it, not from the received buffer (on gloo nothing writes that row there).

[Note: dtypes]
Shards (the optimizer's master copy) keep the model's dtype. Gathers run in `param_dtype`
(e.g. bf16: half the bytes of fp32), so the full parameters and the compute are in it.
Gradients arrive in `param_dtype` and are reduced in `reduce_dtype` (default: fp32, or the
shard dtype when wider), then cast to the shard dtype. The Reduce-Scatter's tag code must be
an integer the reduce dtype holds exactly, also after the All-Reduce across G shard groups
adds G of them: codes are `uid % (exact // G) + 1` with exact = 2**significand bits (bf16 256,
fp16 2048, fp32 2**24), so two units share a code only when their ids differ by a multiple
of exact // G (e.g. 128 units apart in bf16 with G = 2). The gather tag is bits, not a
number: exact in every dtype.

[Note: full-parameter blocks]
The full parameters of one gather are views of one block of `world_size * S` elements taken
from the unit's `BufferPool`, parameter i at offset `world_size * o_i` (its padded full data),
so one `split_with_sizes_copy` per rank moves that rank's row into place. Autograd keeps those
tensors (or views of them) from forward to backward, so `release` cannot drop them: it empties
their storage, and the backward's re-gather fills it again. Two ways (`moves_blocks`):
- CUDA and every other device: `untyped_storage().resize_(0)` frees the memory and `resize_(n)`
  allocates it again (public; FSDP2 does the same), and the caching allocator reuses its blocks.
- CPU, where freeing and allocating go through the C heap: the block's memory moves out of the
  storage into the pool and a pooled block moves back in (`UntypedStorage._swap_data_ptr_`,
  private, not in torch's stubs; tried on torch 2.13, and 2.14.1 in session 2's suite run). The
  pool's few blocks are reused step after step. `python benchmarks/storage_paths.py` (2 ranks,
  medians per step, load 7-8): 20m model, resize_ costs 1.3-4.2% more CPU time than the swap (3 rounds) and 6x the page
  faults (62k vs 10k); 5m model, no difference in CPU time (0.988), 1.25x the faults. A torch
  without `_swap_data_ptr_` takes the resize_ path (tests/test_engine_storage.py trains on both).
The storage moves run inside the hooks, never inside a compiled graph (hooks.py, Note:
torch.compile).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_zero3.engine import reduce
from lightning_zero3.engine.buffers import BufferPool
from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.reduce import PendingReduce
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.tags import OrderMismatchError, exact_integers

__all__ = ["ALIGN_BYTES", "OrderMismatchError", "Unit", "aligned_numel"]

# Moving a block of memory between two storages (Note: full-parameter blocks): private, so
# its absence selects the resize_ path.
_SWAP_STORAGE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

# Each rank's chunk of a collective starts at a multiple of this many bytes (NCCL alignment).
ALIGN_BYTES = 16


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """`numel` rounded up so that `numel` elements of `dtype` fill a multiple of ALIGN_BYTES."""
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-numel // per) * per


def moves_blocks(device: torch.device) -> bool:
    """Whether emptied full-parameter storages on `device` give their memory to the pool and
    take a pooled block back (CPU), rather than being freed and allocated (Note: full-parameter blocks)."""
    return _SWAP_STORAGE and device.type == "cpu"


def tag_numel(dtype: torch.dtype) -> int:
    """Elements of `dtype` that hold the gather tag's 32 bits."""
    return max(1, 4 // dtype.itemsize)


def send_row_numel(shard_numel: int, dtype: torch.dtype) -> int:
    """Elements of one rank's All-Gather row in `dtype`: its shards, the tag, the alignment."""
    return aligned_numel(shard_numel + tag_numel(dtype), dtype)


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
        self.tag_numel = tag_numel(self.param_dtype)
        # The Reduce-Scatter tag code (Note: dtypes).
        groups = replicate.world_size if replicate is not None else 1
        codes = exact_integers(self.reduce_dtype) // groups
        self.reduce_code = uid % codes + 1 if codes >= 1 else 0
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.shard_numel
        # Elements each rank contributes, without the tag.
        self.shard_numel = total
        # The shards as this rank's send row (shard.py, Note: shards in one row), or None.
        self._row = self._adopt_row()
        # Each shard's address when adopted: a shard given other memory since is no longer in the row.
        self._addresses = [p.param.data_ptr() for p in params]
        # Elements of each rank's Reduce-Scatter row: shards, tag column, alignment.
        self.reduce_row_numel = aligned_numel(total + 1, self.reduce_dtype)
        # In-flight or finished-but-unread All-Gather: (work, gathered buffer, its dtype, event
        # after the issue, tag it carries, the row of shards sent as it is or None). The buffer
        # goes back to the pool only after the wait: the collective uses it on its own stream
        # after `start_gather` returns.
        self._pending: tuple[object, torch.Tensor, torch.dtype, object, int, torch.Tensor | None] | None = None
        # Each gather row's tag and alignment tail, per (dtype, device), built once on the device.
        self._tails: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}

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

    @property
    def block_numel(self) -> int:
        """Elements of a full-parameter block: the padded full parameters (Note: full-parameter blocks)."""
        return self.world_size * self.shard_numel

    def row_numel(self, dtype: torch.dtype | None = None) -> int:
        """Elements each rank sends in an All-Gather in `dtype` (default `param_dtype`)."""
        return send_row_numel(self.shard_numel, dtype or self.param_dtype)

    def _like(self) -> torch.Tensor:
        return self.params[0].param

    # ---- gather ---------------------------------------------------------------------------
    def _adopt_row(self) -> torch.Tensor | None:
        """The buffer that holds the shards back to back as the send row (materialize.py lays
        them out so; shard.py, Note: shards in one row), or None where they are not laid out so."""
        if not self.params:
            return None
        first = self.params[0].param
        storage = first.untyped_storage()
        width = self.row_numel(self.shard_dtype)
        if storage.nbytes() < width * self.shard_dtype.itemsize:
            return None
        for p, offset in zip(self.params, self.offsets):
            t = p.param
            if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != offset:
                return None
            if not t.is_contiguous() or t.device != first.device:
                return None
        # A tensor of its own on the storage: writing the tag after the shards leaves the
        # shards' version counters alone.
        return torch.empty(0, dtype=self.shard_dtype, device=first.device).set_(storage, 0, (width,), (1,))

    def _shards_row(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The row of shards to send as it is for a gather in `dtype`, or None: the shards must
        be copied (cast to another dtype, or a shard was given other memory, e.g. `.data =`)."""
        if self._row is None or dtype != self.shard_dtype:
            return None
        for p, address in zip(self.params, self._addresses):
            if p.param.data_ptr() != address:
                return None
        return self._row

    def _tail(self, dtype: torch.dtype, device: torch.device, tag: int) -> torch.Tensor:
        """The row's tag (32 bits) and alignment zeros, as `dtype`, on `device` (cached: no
        host-to-device copy per gather)."""
        key = (dtype, device, tag)
        tail = self._tails.get(key)
        if tail is None:
            numel = self.row_numel(dtype) - self.shard_numel
            raw = torch.zeros(numel * dtype.itemsize, dtype=torch.uint8)
            raw[:4] = torch.tensor([tag], dtype=torch.int32).view(torch.uint8)
            tail = self._tails[key] = raw.view(dtype).to(device)
        return tail

    def start_gather(self, dtype: torch.dtype | None = None, *, tag: int | None = None) -> None:
        """Issue the All-Gather asynchronously (prefetch), in `dtype` (default `param_dtype`).
        No-op if one is already pending. `tag` replaces the unit's own (a departure notice,
        tags.py)."""
        if self._pending is not None or not self.params:
            return
        dtype = dtype or self.param_dtype
        tag = self.tag if tag is None else tag
        like = self._like()
        width = self.row_numel(dtype)
        streams = self.comm.streams(like.device)
        own = self._shards_row(dtype)
        with streams.on("copy_in"), torch.no_grad():
            recv = self.pool.take(self.world_size * width, dtype, like.device)
            mine = recv[self.comm.rank * width : (self.comm.rank + 1) * width]
            tail = self._tail(dtype, like.device, tag)
            if own is None:
                # This rank's row of the output is its send buffer (an in-place All-Gather).
                torch.cat([p.param.detach() for p in self.params], out=mine[: self.shard_numel])  # casts
            else:
                own[self.shard_numel :].copy_(tail)  # the row of shards is sent as it is
            mine[self.shard_numel :].copy_(tail)  # this rank's tag is read from its row, as the others'
            copied = streams.event()
        with streams.on("gather", after=copied):
            send = mine if own is None else own
            work = self.comm.all_gather(recv, send, async_op=True, what=f"unit '{self.name}'", fill_own_row=own is None)
            issued = streams.event()
        self._pending = (work, recv, dtype, issued, tag, own)
        self.comm.tags.in_flight[self.tag] = self._settle_if_arrived

    def _settle_if_arrived(self) -> None:
        """A collective failed elsewhere: if this unit's gather in flight has completed, record
        the tags it brought; never wait for it (tags.py, Note: deferred tag checks)."""
        if self._pending is None or not self.comm.completed(self._pending[0]):
            return
        try:
            gathered, _ = self._wait_gather()
        except OrderMismatchError:
            raise  # the cause, found by the check inside
        except RuntimeError:
            return  # it failed too: the check that follows reports what the others brought
        self.pool.give(gathered.view(-1))

    def discard_gather(self) -> None:
        """Drop a prefetch that the step did not use (the collective still completes)."""
        if self._pending is not None:
            gathered, _ = self._wait_gather()
            self.pool.give(gathered.view(-1))

    def _finish_gather(self) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        """Wait for the pending All-Gather. Returns the (N, row) buffer, the tags its rows carry
        ((N,) int64, a copy: the buffer is reused), the tag this rank sent, and the row of
        shards sent as it is (None: this rank's row of the buffer holds its shards)."""
        assert self._pending is not None
        work, recv, dtype, issued, tag, own = self._pending
        self._pending = None
        self.comm.tags.in_flight.pop(self.tag, None)
        try:
            self.comm.streams(recv.device).wait_for(issued)
            self.comm.wait(work)
        except RuntimeError as err:
            self.comm.tags.raise_pending_mismatch()
            raise self.comm.failed("All-Gather", f"unit '{self.name}'", err) from err
        gathered = recv.view(self.world_size, self.row_numel(dtype))  # (N, row)
        n, s, t = self.world_size, self.shard_numel, tag_numel(dtype)
        bits = gathered[:, s : s + t].contiguous().view(torch.uint8)[:, :4].contiguous()
        return gathered, bits.view(torch.int32).view(n).to(torch.int64), tag, own

    def _wait_gather(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Wait for the pending All-Gather; record its tags (tags.py). Returns the (N, row)
        buffer and the row of shards sent as it is, if any (see `_finish_gather`)."""
        gathered, received, tag, own = self._finish_gather()
        self.comm.tags.expect("All-Gather", self.name, received, [tag] * self.world_size)
        return gathered, own

    def _take_gathered(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gathered (N, row) buffer (give it back to the pool when done with it) and the
        row of shards sent as it is, if any."""
        if self._pending is not None and self._pending[2] != dtype:
            self.discard_gather()
        if self._pending is None:
            self.start_gather(dtype)
        return self._wait_gather()

    def announce(self, tag: int) -> list[int]:
        """Join this unit's All-Gather (what the ranks that follow the recorded order issue
        next) carrying `tag` instead of the unit's; return every rank's tag, read at once."""
        self.start_gather(tag=tag)
        gathered, received, _, _ = self._finish_gather()
        self.pool.give(gathered.view(-1))
        return received.tolist()  # a sync, only when leaving the record

    def gather(self, into: list[torch.Tensor] | None = None, *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Full parameters of the unit, in `dtype` (default `param_dtype`; pass `shard_dtype`
        for the exact master values). With `into` (full tensors that `release` emptied), refill
        those tensors' storage in place instead of allocating new tensors, without bumping their
        version (Note: full-parameter blocks)."""
        gathered, own = self._take_gathered(dtype or self.param_dtype)
        n = self.world_size
        if into is None:
            block = self.pool.take(self.block_numel, gathered.dtype, gathered.device)
            fulls = [block[n * o : n * o + p.numel].view(p.full_shape) for p, o in zip(self.params, self.offsets)]
        else:
            storage = into[0].untyped_storage()
            if storage.size() == 0:
                self._refill(storage, into[0].dtype)
            # A fresh tensor on the same storage: writing through it leaves autograd's version
            # counters of `into` alone.
            empty = torch.empty(0, dtype=into[0].dtype, device=into[0].device)
            block = empty.set_(storage, 0, (self.block_numel,), (1,))
            fulls = list(into)
        sizes = [p.shard_numel for p in self.params]
        with torch.no_grad():
            # One pass per rank: its row's shards -> their places in the padded full data (rank
            # r's shard of parameter i at n * o_i + r * size_i). This rank's shards come from the
            # row of shards when that was sent as it is (nothing copied them into the buffer).
            for r in range(n):
                row = own if own is not None and r == self.comm.rank else gathered[r]
                out = [block[n * o + r * s : n * o + (r + 1) * s] for o, s in zip(self.offsets, sizes)]
                torch.split_with_sizes_copy(row[: self.shard_numel], sizes, out=out)
        self.pool.give(gathered.view(-1))
        return fulls

    def gather_into(self, outputs: list[torch.Tensor], *, dtype: torch.dtype | None = None) -> None:
        """Gather the unit and copy each parameter's full value into `outputs` (tensors of the
        full shapes, on any device, e.g. host memory): for callers that keep whole parameters
        beyond the unit's life. The gathered block goes back to the pool."""
        fulls = self.gather(dtype=dtype)
        with torch.no_grad():
            for out, full in zip(outputs, fulls):
                out.copy_(full)
        self.release(fulls)

    def _refill(self, storage: torch.UntypedStorage, dtype: torch.dtype) -> None:
        """Give an emptied full-parameter storage a block of memory again."""
        if moves_blocks(storage.device):
            block = self.pool.take(self.block_numel, dtype, storage.device)
            # the block's memory moves into `storage`; private API, not in torch's stubs (Note: full-parameter blocks)
            storage._swap_data_ptr_(block.untyped_storage())  # type: ignore[attr-defined]
        else:
            storage.resize_(self.block_numel * dtype.itemsize)

    def release(self, fulls: list[torch.Tensor]) -> None:
        """Empty the storage of full parameters from `gather` while keeping the tensor objects,
        which autograd may have saved; `gather(into=fulls)` refills it. The memory goes back to
        the pool (Note: full-parameter blocks)."""
        if not fulls:
            return
        storage = fulls[0].untyped_storage()  # all full parameters of a gather share it
        if storage.size() == 0:
            return
        if moves_blocks(storage.device) and storage.size() == self.block_numel * fulls[0].element_size():
            holder = torch.empty(0, dtype=fulls[0].dtype, device=fulls[0].device)
            # `storage` is left empty; private API, not in torch's stubs (Note: full-parameter blocks)
            holder.untyped_storage()._swap_data_ptr_(storage)  # type: ignore[attr-defined]
            self.pool.give(holder.set_(holder.untyped_storage(), 0, (self.block_numel,), (1,)))
        else:
            storage.resize_(0)

    # ---- reduce (reduce.py) ---------------------------------------------------------------
    def start_reduce(self, grads: list[torch.Tensor | None]) -> PendingReduce:
        """Issue the Reduce-Scatter of full gradients (None: no gradient) asynchronously (reduce.py)."""
        return reduce.start_reduce(self, grads)

    def start_replication(self, pending: PendingReduce) -> None:
        """With shard groups: All-Reduce the reduced piece across groups, asynchronously (reduce.py)."""
        reduce.start_replication(self, pending)

    def finish_reduce(self, pending: PendingReduce) -> list[torch.Tensor | None]:
        """Wait for `start_reduce`'s collectives; this rank's averaged shard gradients (reduce.py)."""
        return reduce.finish_reduce(self, pending)
