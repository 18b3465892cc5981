"""`RankChecks`: detecting ranks that disagree on which unit they run, as one layer around the
collectives: unit.py and reduce.py stamp a row's check slot before a collective and read it
after; the driver checks when a pass begins and a backward ends; departure.py goes through it.

[Note: check slot]
Every All-Gather row holds, after the shards, `tag_numel(dtype)` elements for the unit's tag (id + 1 as
an int32's bits: exact in every dtype). (docs/design.md, check slot)

[Note: deferred tag checks]
Reading tags after each collective would sync about three times per unit. (docs/design.md, deferred tag
checks)

[Note: rank check modes]
"every_step" (default) checks every step; "first_step" until the first backward ends; an int K
the steps whose count of finished backwards is a multiple of K (alike on every rank). Other steps
stamp, read and announce nothing: a disagreement then fails or hangs in a collective (or, for
units of one size, mixes parameters), as under DDP or FSDP.

[Note: uneven batches]
A rank given more batches than its peers runs a step they never run (a hang or an abort).
(docs/design.md, uneven batches)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero3.engine.buffers import current_event, stream_api
from lightning_zero3.engine.comm import Comm


class OrderMismatchError(RuntimeError):
    """Ranks ran different units at the same point of a step."""


DEPARTED = 1 << 30  # this rank left the recorded order for the unit in the low bits (departure.py)
FINAL = 1 << 29  # this rank runs the last batch of its epoch (Note: uneven batches)
UNEVEN_FIX = (
    "a DistributedSampler (it pads to equal lengths), `drop_last=True` on a sampler or DataLoader that splits data "
    "per rank, or equal per-rank datasets."
)


def exact_integers(dtype: torch.dtype) -> int:
    """Largest n such that every integer in [0, n] is exact in `dtype` (fp32: 2**24)."""
    if dtype.is_floating_point:
        significand_bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # eps = 2**-(stored bits)
        return 2**significand_bits
    return torch.iinfo(dtype).max


def tag_numel(dtype: torch.dtype) -> int:
    """Elements of `dtype` that hold a tag's 32 bits (Note: check slot)."""
    return max(1, 4 // dtype.itemsize)


def read_tags(slots: torch.Tensor) -> torch.Tensor:
    """The tags in (N, tag_numel) `slots` of any dtype, as (N,) int64 (a copy)."""
    n = slots.shape[0]
    bits = slots.contiguous().view(torch.uint8)[:, :4].contiguous()
    return bits.view(torch.int32).view(n).to(torch.int64)


@dataclass
class _Record:
    collective: str  # "All-Gather", "Reduce-Scatter" or "All-Reduce"
    unit: str  # the unit this rank ran
    expected: list[int]  # what the received integers must be
    received: torch.Tensor  # `expect`'s
    ready: Callable[[], None] | None = None  # makes the current stream wait for `received` (Note: deferred tag checks)


@dataclass
class _Read:
    """Records whose tags are on their way to the host (Note: deferred tag checks)."""

    records: list[_Record]
    host: torch.Tensor  # int64 on the host (pinned on a GPU), valid once `landed` has passed
    landed: Any  # event after the copy; None: on the host already
    step: int  # the backwards finished when it was sent


class RankChecks:
    """Tags stamped into the check slots and read back, checked once per step."""

    def __init__(self, *, rank: int, names: list[str], rank_checks: str | int = "every_step", groups: int = 1) -> None:
        self.rank = rank
        self.names = names  # unit names by id, for messages
        # Steps between checks; None: the first step only (Note: rank check modes).
        self.every = None if rank_checks == "first_step" else 1 if rank_checks == "every_step" else int(rank_checks)
        self.groups = groups  # shard groups whose All-Reduce adds the reduce codes
        self.steps = 0  # backwards finished
        self._records: list[_Record] = []
        self.closely = True  # Note: deferred tag checks
        # What the checks cost: device-to-host reads that wait (none in a steady step), integers read.
        self.host_reads = 0
        self.tags_read = 0
        self._reads: deque[_Read] = deque()  # sent by `check_soon`, oldest first
        self.in_flight: dict[int, Callable[[], None]] = {}  # unit id -> settle (Note: deferred tag checks)
        self._stamps: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}
        self._columns: dict[tuple[torch.dtype, torch.device, int, int, int], torch.Tensor] = {}  # Reduce-Scatter stamps
        self._tails: dict[tuple[Any, ...], torch.Tensor] = {}  # `reduce_tail`'s, per unit, rank and shape
        self.final_batch = False  # set by the strategy, cleared when the backward ends (Note: uneven batches)
        self.uneven_fix = UNEVEN_FIX  # how, in the words of whoever sets `final_batch`

    @property
    def active(self) -> bool:
        """Whether this step stamps and checks (Note: rank check modes)."""
        if self.steps == 0:
            return True
        return self.every is not None and self.steps % self.every == 0

    def name(self, uid: int) -> str:
        return self.names[uid] if 0 <= uid < len(self.names) else f"<unknown unit {uid}>"

    # ---- the interface of the gather and reduce code ------------------------------------------
    def stamp_gather(self, slot: torch.Tensor, tag: int) -> bool:
        """Write `tag` into this rank's gather `slot`; False on a step not checked."""
        if not self.active:
            return False
        key = (slot.dtype, slot.device, tag)
        stamp = self._stamps.get(key)
        if stamp is None:  # built once on the device: no host-to-device copy per gather
            raw = torch.zeros(slot.numel() * slot.element_size(), dtype=torch.uint8)
            raw[:4] = torch.tensor([tag], dtype=torch.int32).view(torch.uint8)
            stamp = self._stamps[key] = raw.view(slot.dtype).to(slot.device)
        slot.copy_(stamp)
        return True

    def tag(self, uid: int, *, notice: bool = False) -> int:
        return (DEPARTED if notice else 0) | (FINAL if self.final_batch else 0) | (uid + 1)

    def read_gather(self, unit: str, slots: torch.Tensor, tag: int) -> None:
        """Record the tags a stamped gather brought, which must all be `tag`."""
        self.expect("All-Gather", unit, read_tags(slots), [tag] * slots.shape[0])

    def reduce_code(self, uid: int, dtype: torch.dtype) -> int:
        """Unit `uid`'s code in a Reduce-Scatter column of `dtype` (Note: check slot)."""
        codes = exact_integers(dtype) // self.groups
        return uid % codes + 1 if codes >= 1 else 0

    def stamp_reduce(self, column: torch.Tensor, uid: int, rank: int) -> bool:
        """Write unit `uid`'s code into `column` (N,) for the next rank; False on an unchecked step."""
        if not self.active:
            return False
        n = column.shape[0]
        key = (column.dtype, column.device, uid, rank, n)
        stamp = self._columns.get(key)
        if stamp is None:  # built once on the device: writing a Python int would copy from the host each step
            stamp = torch.zeros(n, dtype=column.dtype)
            stamp[(rank + 1) % n] = self.reduce_code(uid, column.dtype)
            stamp = self._columns[key] = stamp.to(column.device)
        column.copy_(stamp)
        return True

    def reduce_tail(
        self, uid: int, rank: int, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, bool]:
        """The (N, columns) end of a Reduce-Scatter input after the gradients (reduce.py): unit
        `uid`'s check column for the next rank, then zeros; all zeros, and False, on an unchecked
        step. Built once on the device."""
        stamped = self.active
        key = (dtype, device, uid if stamped else -1, rank, *shape)
        tail = self._tails.get(key)
        if tail is None:
            tail = torch.zeros(shape, dtype=dtype)
            if stamped:
                self.stamp_reduce(tail[:, 0], uid, rank)
            tail = self._tails[key] = tail.to(device)
        return tail, stamped

    def read_reduce(
        self,
        collective: str,
        unit: str,
        received: torch.Tensor,
        uid: int,
        dtype: torch.dtype,
        *,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Record the code a stamped reduction brought (after the All-Reduce: G codes summed);
        `ready` orders the read after `received`'s stream (None: it is the current one)."""
        code = self.reduce_code(uid, dtype) * (self.groups if collective == "All-Reduce" else 1)
        self.expect(collective, unit, received, [code], ready=ready)

    # ---- the ledger -----------------------------------------------------------------------------
    def expect(
        self,
        collective: str,
        unit: str,
        received: torch.Tensor,
        expected: list[int],
        *,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Remember `received` (int64 on the device, a copy nothing else writes) that should equal
        `expected`; check at once when watching closely. `ready`: see `_Record`."""
        self._records.append(_Record(collective, unit, expected, received, ready))
        if self.closely:
            self.check()

    def check(self) -> None:
        """Read every pending record now (one device-to-host copy, a sync) and every copy
        `check_soon` sent (waiting for it); raise `OrderMismatchError` for the first that differs.
        No sync when nothing is pending."""
        while self._reads:
            self._read(wait=True)
        if not self._records:
            return
        records, self._records = self._records, []
        self._ready(records)
        self.host_reads += 1
        got = torch.cat([record.received for record in records]).tolist()  # the one device-to-host copy
        self._compare(records, got, self.steps)

    def check_soon(self) -> None:
        """Send the pending records to the host without waiting and check the copies that have
        landed (Note: deferred tag checks); on this rank's last batch, check all now (Note:
        uneven batches)."""
        if self.final_batch:
            self.check()
            return
        if self._records:
            records, self._records = self._records, []
            self._ready(records)
            received = torch.cat([record.received for record in records])
            host, landed = received, None
            if received.device.type != "cpu":
                host = torch.empty(received.shape, dtype=received.dtype, pin_memory=True)
                host.copy_(received, non_blocking=True)
            if stream_api(received.device) is not None:
                landed = current_event(received.device)
            self._reads.append(_Read(records, host, landed, self.steps))
        while self._reads:
            landed = self._reads[0].landed
            if len(self._reads) == 1 and landed is not None and not landed.query():
                return  # the newest copy may land later: never waited for
            self._read(wait=len(self._reads) > 1)

    @staticmethod
    def _ready(records: list[_Record]) -> None:
        for record in records:
            if record.ready is not None:  # produced on another stream (reduce.py: across shard groups)
                record.ready()

    def _read(self, *, wait: bool) -> None:
        """Check the oldest copy `check_soon` sent, waiting for it with `wait` if not landed."""
        read = self._reads.popleft()
        if read.landed is not None and not read.landed.query():
            assert wait
            self.host_reads += 1
            read.landed.synchronize()
        # Host memory (pinned on a GPU): read through numpy, not `Tensor.tolist`, which would be
        # a read of device memory where the tensor is a device's.
        self._compare(read.records, read.host.numpy().tolist(), read.step)

    def _compare(self, records: list[_Record], got: list[int], step: int) -> None:
        self.tags_read += len(got)
        start = 0
        for record in records:
            seen = got[start : start + len(record.expected)]
            start += len(seen)
            if seen != record.expected:
                late = self.steps - step
                later = f" (read {late} backward(s) later: checks.py, Note: deferred tag checks)" if late else ""
                raise OrderMismatchError(self._message(record, seen) + later)

    def step_done(self) -> None:
        self.steps += 1
        self.final_batch = False

    def describe_tag(self, tag: int) -> str:
        final = " (its last batch)" if tag & FINAL else ""
        tag &= ~FINAL
        if tag & DEPARTED:
            return f"'{self.name((tag & ~DEPARTED) - 1)}' (departed from the recorded order){final}"
        return f"'{self.name(tag - 1)}'{final}"

    def _message(self, record: _Record, seen: list[int]) -> str:
        last = [r for r, t in enumerate(seen) if t & FINAL]
        if record.collective == "All-Gather" and last and len(last) < len(seen):
            more = [r for r in range(len(seen)) if r not in last]
            return (
                f"Uneven batch counts (All-Gather of unit '{record.unit}', rank {self.rank}): ranks {last} run the "
                f"last training batch of their epoch while ranks {more} have more batches; the ranks would run "
                f"different numbers of steps and their collectives would pair wrongly (a hang or an abort). Give "
                f"every rank the same number of batches: {self.uneven_fix}"
            )
        if record.collective == "All-Gather":
            where = ", ".join(f"rank {r}: {self.describe_tag(t)}" for r, t in enumerate(seen))
            detail = f"this rank expected unit '{record.unit}' but the ranks were at [{where}]"
        else:
            detail = (
                f"this rank reduced unit '{record.unit}' but another rank of its shard group reduced a different "
                f"unit of the same size (tag column {seen}, expected {record.expected})"
            )
        return f"{record.collective} mismatch on rank {self.rank}: {detail}. {AGREE}"

    def raise_pending_mismatch(self) -> None:
        """A collective failed: a mismatch already recorded is the cause (the peer that noticed
        first has left)."""
        for settle in list(self.in_flight.values()):
            settle()
        try:
            self.check()
        except OrderMismatchError:
            raise
        except RuntimeError:  # the device itself is in trouble: report the collective's error
            pass

    # ---- the first step's record, compared across ranks ---------------------------------------
    def agree_on_orders(self, world_comm: Comm, forward: list[int], backward: list[int]) -> None:
        """Raise, on every rank, if the recorded unit orders differ between ranks."""
        every: list[Any] = world_comm.all_gather_object((forward, backward))
        for phase, index in (("forward", 0), ("backward", 1)):
            ref = every[0][index]
            for rank, orders in enumerate(every[1:], start=1):
                got = orders[index]
                pos = next((i for i in range(max(len(ref), len(got))) if ref[i : i + 1] != got[i : i + 1]), None)
                if pos is not None:
                    expected = self.name(ref[pos]) if pos < len(ref) else "<nothing>"
                    found = self.name(got[pos]) if pos < len(got) else "<nothing>"
                    raise OrderMismatchError(
                        f"Ranks ran units in different {phase} orders: at position {pos} rank 0 ran "
                        f"'{expected}' but rank {rank} ran '{found}'. {AGREE}"
                    )


AGREE = (
    "Every rank must run the same units in the same order each step; data-dependent control flow (a block "
    "skipped on some ranks, a unit whose output reaches the loss on some ranks only) is not supported under "
    "ZeRO-3. Make the branch decision identical on all ranks."
)


__all__ = ["DEPARTED", "FINAL", "OrderMismatchError", "RankChecks", "exact_integers", "read_tags", "tag_numel"]
