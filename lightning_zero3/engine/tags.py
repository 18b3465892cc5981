"""`TagLedger`: unit tags read off the wire are checked once per step, not once per collective.

[Note: deferred tag checks]
Every All-Gather row ends with the unit's tag and every Reduce-Scatter carries a tag column
(unit.py, Note: flat layout and unit tag). Comparing them on the host after each collective
would read device memory (a device-to-host sync) about three times per unit: the GPU queue
drains and the CPU can no longer run ahead, so prefetching hides nothing. Instead each
collective leaves a few integers on the device (a copy of the tags it received) with what they
should be, and `check()` reads all of them with one copy at the end of backward, before the
optimizer can use the gradients, and at the start of the next pass for passes without backward.
A mismatch raises the same `OrderMismatchError`, naming the first unit that differed.

The deferred check costs nothing when ranks agree. When they do not, the collectives after the
first mismatch pair up wrongly; so the ledger checks at once (`closely`) whenever this rank has
no recorded order yet or has departed from it, and a rank whose collective fails (its peer
raised and left) raises the recorded mismatch rather than the echo. The mismatch may have
arrived in a gather this rank prefetched and has not waited for yet (units kept for backward,
hooks.py, shift where ranks on different paths first differ): before the check, every gather in
flight whose collective has completed records its tags (`settle`); one still running is never
waited for, so a failing rank cannot hang on it. A rank that departs from
the recorded order alone first announces it (`hooks.py` calls `ShardedModel.before_gather`):
it joins the All-Gather the others issue next, with their size, carrying a marked tag, so no
rank meets a collective of an unexpected size (which gloo answers by aborting the process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class OrderMismatchError(RuntimeError):
    """Ranks ran different units at the same point of a step."""


# A gather tag with this bit set says "this rank departed from the recorded order and runs the
# unit whose tag is in the low bits" (see Note: deferred tag checks).
DEPARTED = 1 << 30


@dataclass
class _Record:
    collective: str  # "All-Gather" or "Reduce-Scatter"
    unit: str  # the unit this rank ran
    expected: list[int]  # what the received integers must be
    start: int  # offset of this record's integers in the concatenation


class TagLedger:
    """Tags received on the device, waiting for the once-per-step check."""

    def __init__(self, *, rank: int, unit_name: Callable[[int], str]) -> None:
        self.rank = rank
        self._unit_name = unit_name  # uid -> name, for messages
        self._records: list[_Record] = []
        self._values: list[torch.Tensor] = []  # int64 device tensors, one per record
        self._numel = 0
        # Check every record at once (first pass, or this rank departed from the record).
        self.closely = True
        # Device-to-host reads issued by checks: the engine's only per-step sync.
        self.host_reads = 0
        # Gathers in flight, by unit tag: a callable that records the gather's tags if its
        # collective has completed and never waits (Note: deferred tag checks).
        self.in_flight: dict[int, Callable[[], None]] = {}

    def set_unit_names(self, unit_name: Callable[[int], str]) -> None:
        self._unit_name = unit_name

    def describe_tag(self, tag: int) -> str:
        if tag & DEPARTED:
            return f"'{self._unit_name((tag & ~DEPARTED) - 1)}' (departed from the recorded order)"
        return f"'{self._unit_name(tag - 1)}'"

    def expect(self, collective: str, unit: str, received: torch.Tensor, expected: list[int]) -> None:
        """Remember `received` (int64, on the device; a copy nothing else writes) that should
        equal `expected`; check at once when watching closely."""
        self._records.append(_Record(collective, unit, expected, self._numel))
        self._values.append(received)
        self._numel += len(expected)
        if self.closely:
            self.check()

    def check(self) -> None:
        """Read every pending record with one device-to-host copy; raise `OrderMismatchError`
        for the first that differs. A no-op (no sync) when nothing is pending."""
        if not self._records:
            return
        records, values = self._records, self._values
        self._records, self._values, self._numel = [], [], 0
        self.host_reads += 1
        got = torch.cat(values).tolist()  # the one device-to-host copy
        for record in records:
            seen = got[record.start : record.start + len(record.expected)]
            if seen != record.expected:
                raise OrderMismatchError(self._message(record, seen))

    def _message(self, record: _Record, seen: list[int]) -> str:
        if record.collective == "All-Gather":
            where = ", ".join(f"rank {r}: {self.describe_tag(t)}" for r, t in enumerate(seen))
            detail = f"this rank expected unit '{record.unit}' but the ranks were at [{where}]"
        else:
            detail = (
                f"this rank reduced unit '{record.unit}' but another rank of its shard group reduced a different "
                f"unit of the same size (tag column {seen}, expected {record.expected})"
            )
        return (
            f"{record.collective} mismatch on rank {self.rank}: {detail}. Every rank must run the same "
            f"units in the same order each step; data-dependent control flow (a block skipped on some "
            f"ranks, a unit whose output reaches the loss on some ranks only) is not supported under "
            f"ZeRO-3. Make the branch decision identical on all ranks."
        )

    def raise_pending_mismatch(self) -> None:
        """Called when a collective failed: if a tag already showed that ranks disagree, that
        is the cause, not the failure (the peer that noticed first has left)."""
        for settle in list(self.in_flight.values()):
            settle()
        try:
            self.check()
        except OrderMismatchError:
            raise
        except RuntimeError:  # the device itself is in trouble: report the collective's error
            pass


def exact_integers(dtype: torch.dtype) -> int:
    """Largest n such that every integer in [0, n] is exactly representable in `dtype`:
    2**(significand bits), e.g. bf16 256, fp16 2048, fp32 2**24, fp64 2**53."""
    if dtype.is_floating_point:
        significand_bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # eps = 2**-(stored bits)
        return 2**significand_bits
    return torch.iinfo(dtype).max


def announce_departure(model: Any, unit: Any, *, backward: bool) -> None:
    """Called before `unit` is gathered (hooks.py). If running it leaves the recorded order,
    watch closely from now on, and join the All-Gather the ranks that still follow the record
    issue next, with a tag saying which unit this rank runs instead (Note: deferred tag
    checks). If every rank departed alike, carry on (a changed order is legal when all agree);
    otherwise raise, while the others find the marked tag at their next check or failure."""
    schedule = model.schedule
    position = schedule.departure(unit.uid, backward=backward)
    if position is None:
        return
    ledger: TagLedger = model.comm.tags
    ledger.closely = True
    ledger.check()
    order = schedule.backward_order if backward else schedule.forward_order
    # What a rank on the record gathers next: the unit itself at the start of a pass or
    # without prefetch, else the unit `prefetch` places ahead.
    ahead = position if position == 0 or schedule.prefetch == 0 else position + schedule.prefetch
    if backward:
        # Units kept from forward into backward are never gathered there (hooks.py, Note: kept
        # for backward): the others' next gather is the first unit after them. This rank kept
        # what they kept (its forward followed the same record) and has not reached them yet.
        while ahead < len(order) and model.hooks.is_kept(model.units[order[ahead]]):
            ahead += 1
    if ahead >= len(order):
        return  # nothing predictable: the tag checks at the next collectives must do
    expected = model.units[order[ahead]]
    # A unit this rank holds may still be what the others gather next: an outer unit open at
    # `position` and called again right after it (their prefetch skips it, their next gather is
    # its own). So holding it is no reason to skip the notice (tests/test_engine_tags.py).
    if not expected.params or expected.gather_in_flight:
        return
    notice = DEPARTED | unit.tag
    tags = expected.announce(notice)
    if tags != [notice] * len(tags):
        where = ", ".join(f"rank {r}: {ledger.describe_tag(t)}" for r, t in enumerate(tags))
        phase = "backward" if backward else "forward"
        raise OrderMismatchError(
            f"Order mismatch on rank {ledger.rank}: at {phase} position {position} this rank ran unit "
            f"'{unit.name}' where the recorded order, which the other ranks followed, has "
            f"'{model.units[order[position]].name}' (the ranks' All-Gather tags: [{where}]). Every rank "
            f"must run the same units in the same order each step; data-dependent control flow is not "
            f"supported under ZeRO-3. Make the branch decision identical on all ranks."
        )
