"""The quantized collectives (`quantize_weights`, `quantize_gradients`): the block codec, rows of
floats to packed rows of bytes and back, and how packed rows go over a transport. It knows rows,
never units; comm.py chooses and counts.

[Note: quantized collectives]
With the options (config.py, `Quantization`) a `Comm` packs rows around the same transports: an
All-Gather sends this rank's packed row and decodes every row, its own too, into the caller's
rows when waited for (all ranks compute with the same weights); a Reduce-Scatter becomes an
all-to-all of packed rows, each decoded and summed in rank order in the reduce dtype, so each
contribution is rounded once, however many ranks; with shard groups the All-Reduce of the
reduced shards across them is an All-Gather of packed rows, each rank decoding and summing all
(its own too) in rank order, so every group holds the same sum, each contribution rounded once.
Only what the caller marks (`quantize_data`:
a row's leading elements) is quantized: check slots and padding travel bit for bit; exact
gathers (checkpoints, whole parameters, master values) pass None. The counters count the packed
bytes, what is sent. One rank sends nothing: nothing is quantized. Not quantized either: the
slices of reshard_after_forward=G (model.py gives their Comm no quantization): those hold the
weights forward decoded, so backward computes with them.

[Note: packed once per change]
A unit's row changes only when its shards do, yet it is gathered many times a step (forward,
backward's re-gather, each micro-batch, validation): its codes and scales are kept (`KeptPacked`,
~(1 + 4/B)/4 of the fp32 shard) and sent again while the shards' state is the one they were
packed at, so the same bytes travel as if packed anew. The state (unit.py, `Unit.shard_state`)
is the shards' version counters and storage addresses, and the count of engine-seen writes
(shard.py, Note: shard writes): every `torch.optim` step, state-dict and checkpoint loads. Not
seen: a write through `.data` outside an optimizer's step (autograd counts no version there):
write the parameter itself under `torch.no_grad()`. `Tensor._version` is private (plan.py, Note:
nn.Module's registries). Only the tail (check slot, padding) is copied anew each gather.

[Note: packed row]
A row of `width` elements whose first `data` may be quantized (the rest, a unit's check slot and
padding, travels bit for bit) is packed into `RowCodec.row_bytes` bytes:
  [values: `data` codes | scales: one fp32 per block | tail: the raw bytes of elements data..width | zeros]
Blocks are `block` consecutive elements of the row (the last one may be short); each has the
symmetric scale absmax / qmax (qmax 127 for int8, 7 for int4) and the codes round(x / scale), so
no element moves by more than scale / 2. int4 codes are two per byte (element 2k in the low
nibble, biased by 8). Values and scales end on 4-byte boundaries and rows on 16 (unit.py,
ALIGN_BYTES). A block holding inf or NaN decodes to non-finite values: an overflow (fp16 loss
scaling) stays visible to the step that checks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_zero3.engine.buffers import BufferPool
from lightning_zero3.engine.transport import Transport, Works

__all__ = ["KeptPacked", "RowCodec", "pack_all_reduce", "pack_gather", "pack_reduce", "packed_row_bytes"]


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


def packed_row_bytes(data: int, tail_bytes: int, *, block: int, bits: int) -> int:
    """Bytes of one packed row (Note: packed row) for `data` quantized elements."""
    return _up(_up(-(-data * bits // 8), 4) + 4 * -(-data // block) + tail_bytes, 16)


@dataclass(frozen=True)
class RowCodec:
    """Packs rows of `width` elements of which the first `data` are quantized (Note: packed row)."""

    width: int
    data: int
    itemsize: int  # of the rows' dtype
    block: int
    bits: int  # 8 or 4

    def __post_init__(self) -> None:
        assert self.bits in (4, 8) and 0 <= self.data <= self.width and self.block % 2 == 0

    @property
    def blocks(self) -> int:
        return -(-self.data // self.block)

    @property
    def value_bytes(self) -> int:
        return _up(-(-self.data * self.bits // 8), 4)

    @property
    def tail_bytes(self) -> int:
        return (self.width - self.data) * self.itemsize

    @property
    def row_bytes(self) -> int:
        return packed_row_bytes(self.data, self.tail_bytes, block=self.block, bits=self.bits)

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def tail_start(self) -> int:  # the bytes of codes and scales
        return self.value_bytes + 4 * self.blocks

    def _parts(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, tail) views of (R, row_bytes) `packed`."""
        v, s = self.value_bytes, self.tail_start
        return packed[:, :v], packed[:, v:s].view(torch.float32), packed[:, s : s + self.tail_bytes]

    def quantize(self, rows: torch.Tensor, packed: torch.Tensor) -> None:
        """Pack (R, width) float `rows` into (R, row_bytes) uint8 `packed`."""
        r, d, b = rows.shape[0], self.data, self.blocks * self.block
        codes, scales, _ = self._parts(packed)
        x = F.pad(rows[:, :d].float(), (0, b - d)).view(r, self.blocks, self.block)  # (R, blocks, block)
        torch.div(x.abs().amax(dim=2), self.qmax, out=scales)
        inverse = torch.where(scales > 0, scales.reciprocal(), 0.0)  # an all-zero block: codes 0, scale 0
        q = x.mul_(inverse.unsqueeze(2)).round_().clamp_(-self.qmax, self.qmax).view(r, b)[:, :d]
        if self.bits == 8:
            codes[:, :d].copy_(q.to(torch.int8).view(torch.uint8))
        else:  # two codes a byte, biased into 0..15 (Note: packed row)
            q = F.pad(q, (0, d % 2)).add_(8).to(torch.uint8).view(r, -1, 2)
            codes[:, : q.shape[1]].copy_(q[:, :, 0] | (q[:, :, 1] << 4))
        self.copy_tail(rows, packed)

    def copy_tail(self, rows: torch.Tensor, packed: torch.Tensor) -> None:
        """The elements of `rows` after `data`, bit for bit, into `packed`'s tail."""
        if self.tail_bytes:
            self._parts(packed)[2].copy_(rows[:, self.data :].contiguous().view(torch.uint8))

    def dequantize(self, packed: torch.Tensor, rows: torch.Tensor) -> None:
        """Unpack (R, row_bytes) `packed` into (R, width) `rows` (any float dtype)."""
        r, d = packed.shape[0], self.data
        codes, scales, tail = self._parts(packed)
        if self.bits == 8:
            q = codes[:, :d].view(torch.int8).float()
        else:
            pairs = codes[:, : -(-d // 2)]
            q = torch.stack([pairs & 15, pairs >> 4], dim=2).view(r, -1)[:, :d].float().sub_(8)
        q = F.pad(q, (0, self.blocks * self.block - d)).view(r, self.blocks, self.block)
        rows[:, :d].copy_(q.mul_(scales.unsqueeze(2)).view(r, -1)[:, :d])  # casts to the rows' dtype
        if self.tail_bytes:
            rows[:, d:].view(torch.uint8).copy_(tail)


class KeptPacked:
    """One sender's codes and scales, kept to be sent again while the caller's `state` of the
    values is the one they were packed at (Note: packed once per change)."""

    def __init__(self) -> None:
        self.state: object = None
        self.codes_and_scales: torch.Tensor | None = None  # the first `tail_start` bytes of the packed row

    def pack(self, codec: RowCodec, row: torch.Tensor, packed: torch.Tensor, state: object) -> None:
        """Pack (1, width) `row` into (1, row_bytes) `packed`, quantizing only if `state` changed."""
        kept, n = self.codes_and_scales, codec.tail_start
        if kept is not None and kept.numel() == n and self.state == state:
            packed[0, :n].copy_(kept)
            codec.copy_tail(row, packed)  # the check slot changes every gather
            return
        codec.quantize(row, packed)
        self.codes_and_scales, self.state = packed[0, :n].clone(), state

    def forget(self) -> None:
        self.state, self.codes_and_scales = None, None


Issue = Callable[[Transport], Works]


def pack_gather(
    rows: torch.Tensor, rank: int, codec: RowCodec, pool: BufferPool, kept: tuple[KeptPacked, object] | None = None
) -> tuple[torch.Tensor, Issue]:
    """Pack this rank's row of (N, width) `rows` (through `kept`: (the kept codes, the values'
    state)); the packed rows (N, row_bytes) and the issue, whose wait decodes every row into
    `rows` (Note: quantized collectives)."""
    packed = pool.take("packed", rows.shape[0] * codec.row_bytes, torch.uint8, rows.device).view(rows.shape[0], -1)
    with torch.no_grad():
        if kept is None:
            codec.quantize(rows[rank : rank + 1], packed[rank : rank + 1])
        else:
            kept[0].pack(codec, rows[rank : rank + 1], packed[rank : rank + 1], kept[1])

    def decode() -> None:
        with torch.no_grad():
            codec.dequantize(packed, rows)
        pool.give("packed", packed.view(-1))

    return packed, lambda transport: Works([transport.all_gather(packed)], then=decode)


def pack_reduce(
    output: torch.Tensor, rows: torch.Tensor, codec: RowCodec, pool: BufferPool
) -> tuple[torch.Tensor, Issue]:
    """Pack (N, width) `rows`, row j for rank j; the packed rows and the issue of the all-to-all,
    whose wait decodes the rows received into `rows` and sums them in rank order into `output`."""
    n, size = rows.shape[0], rows.shape[0] * codec.row_bytes
    sent, received = (pool.take("packed", size, torch.uint8, rows.device).view(n, -1) for _ in range(2))
    with torch.no_grad():
        codec.quantize(rows, sent)

    def add_up() -> None:
        with torch.no_grad():
            codec.dequantize(received, rows)
            _sum_rows(rows, output.view(-1))
        pool.give("packed", sent.view(-1))
        pool.give("packed", received.view(-1))

    return sent, lambda transport: Works([transport.all_to_all(received, sent)], then=add_up)


def pack_all_reduce(
    tensor: torch.Tensor, rank: int, n: int, codec: RowCodec, pool: BufferPool
) -> tuple[torch.Tensor, Issue]:
    """Pack 1-D `tensor` as this rank's row of n; the packed rows and the issue of their
    All-Gather, whose wait decodes every row, this rank's too, and sums them in rank order into
    `tensor`: the same sum on every rank (Note: quantized collectives)."""
    rows = pool.take("packed", n * codec.width, tensor.dtype, tensor.device).view(n, -1)
    rows[rank].copy_(tensor)
    packed, gather = pack_gather(rows, rank, codec, pool)

    def issue(transport: Transport) -> Works:
        works = gather(transport)
        decode = works.then
        assert decode is not None

        def add_up() -> None:
            decode()
            with torch.no_grad():
                _sum_rows(rows, tensor)
            pool.give("packed", rows.view(-1))

        works.then = add_up
        return works

    return packed, issue


def _sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """The rows of (n, width) `rows` summed in rank order into 1-D `out`."""
    torch.add(rows[0], rows[1], out=out) if rows.shape[0] > 1 else out.copy_(rows[0])
    for row in rows[2:]:
        out.add_(row)
