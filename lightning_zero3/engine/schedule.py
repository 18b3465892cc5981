"""Execution-order recording and prefetch decisions.

The first pass records the order in which units run forward (a pass without backward too, while
nothing is recorded), and the first backward the order in which their backward starts. From
then on, when unit k starts (forward) or its backward starts, the next `prefetch` units of the
recorded order are gathered asynchronously so the All-Gather overlaps with unit k's compute. A
pass that departs from the record stops prefetching for the rest of that pass (units are then
gathered on demand, and the prefetches already issued from the record are dropped) and becomes
the new record: it is as correct as the record, only slower for one step. Ranks compare their
records once, after the first backward, so a rank running a different order fails with the
first differing unit named (checks.py). `Prefetcher` issues those gathers for the driver.
"""

from __future__ import annotations

from lightning_zero3.engine.calls import CallTable, engine_mode
from lightning_zero3.engine.record import LiveUnits
from lightning_zero3.engine.unit import Unit


class Schedule:
    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        # Unit ids in the order they ran in the last recorded pass (None: nothing recorded).
        self.forward_order: list[int] | None = None
        self.backward_order: list[int] | None = None
        # What the pass in progress has run so far.
        self._forward_seen: list[int] = []
        self._backward_seen: list[int] = []
        # Whether the pass in progress still follows the record (prefetch only while it does).
        self._forward_on_track = True
        self._backward_on_track = True
        self.passes_recorded = 0

    @property
    def forward_on_track(self) -> bool:
        """Whether the forward pass in progress still follows the record."""
        return self._forward_on_track

    @property
    def backward_on_track(self) -> bool:
        """Whether the backward pass in progress still follows the record."""
        return self._backward_on_track

    @property
    def forward_complete(self) -> bool:
        """Whether the forward pass in progress has run the whole recorded order (and no more)."""
        order = self.forward_order
        return self._forward_on_track and order is not None and len(self._forward_seen) == len(order)

    def begin_forward(self) -> None:
        self._forward_seen = []
        self._forward_on_track = True

    def begin_backward(self) -> None:
        self._backward_seen = []
        self._backward_on_track = True

    @staticmethod
    def _next(order: list[int] | None, seen: list[int], uid: int, on_track: bool, count: int) -> tuple[list[int], bool]:
        position = len(seen)
        seen.append(uid)
        if order is None or not on_track or count == 0:
            return [], on_track and order is not None
        if position >= len(order) or order[position] != uid:
            return [], False
        return order[position + 1 : position + 1 + count], True

    def on_forward(self, uid: int) -> list[int]:
        """Record that unit `uid` starts forward; return the units to prefetch now."""
        ahead, self._forward_on_track = self._next(
            self.forward_order, self._forward_seen, uid, self._forward_on_track, self.prefetch
        )
        return ahead

    def on_backward(self, uid: int) -> list[int]:
        """Record that unit `uid` starts backward; return the units to prefetch now."""
        ahead, self._backward_on_track = self._next(
            self.backward_order, self._backward_seen, uid, self._backward_on_track, self.prefetch
        )
        return ahead

    def departure(self, uid: int, *, backward: bool) -> int | None:
        """The position at which running unit `uid` next would leave the recorded order, or
        None if it follows the record (or the pass has left it already, or none exists)."""
        order = self.backward_order if backward else self.forward_order
        seen = self._backward_seen if backward else self._forward_seen
        on_track = self._backward_on_track if backward else self._forward_on_track
        if order is None or not on_track:
            return None
        position = len(seen)
        return None if position < len(order) and order[position] == uid else position

    def end_forward(self) -> None:
        """A pass's forward ended: with nothing recorded yet, its order becomes the record, so
        evaluation, prediction and generation before any training step prefetch from their
        second pass on (a backward that follows records both orders anyway)."""
        if self.forward_order is None and self._forward_seen:
            self.forward_order = list(self._forward_seen)

    def end_backward(self) -> None:
        """Adopt the pass just finished as the record if it differs from it."""
        if self._forward_seen and self._forward_seen != self.forward_order:
            self.forward_order = list(self._forward_seen)
        if self._backward_seen and self._backward_seen != self.backward_order:
            self.backward_order = list(self._backward_seen)
        self.passes_recorded += 1


class Prefetcher:
    """The gathers issued ahead of the units that run next in the record."""

    def __init__(self, units: list[Unit], *, schedule: Schedule, calls: CallTable, live: LiveUnits) -> None:
        self.units = units
        self.schedule = schedule
        self.calls = calls  # a unit on its modules or kept needs no prefetch
        self.live = live
        # Units whose gather was issued ahead; some may have been used since.
        self._prefetched: list[Unit] = []

    def ahead(self, unit: Unit, *, backward: bool) -> None:
        """`unit` starts: gather the units the record says come next; if it just left the
        record, drop the prefetches issued from it."""
        schedule = self.schedule
        on_track = schedule.backward_on_track if backward else schedule.forward_on_track
        for ahead in (schedule.on_backward if backward else schedule.on_forward)(unit.uid):
            self._prefetch(self.units[ahead])
        if on_track and not (schedule.backward_on_track if backward else schedule.forward_on_track):
            self.drop_stale()

    def _prefetch(self, unit: Unit) -> None:
        slot = self.calls.slots[unit.uid]
        if not unit.params or unit.gather_in_flight or slot.call is not None or slot.kept is not None:
            return
        with engine_mode():
            unit.start_gather()
        self._prefetched.append(unit)
        self.live.change(unit.uid, 0, unit.gather_in_flight)

    def drop_stale(self) -> None:
        """The pass just departed from the recorded order: drop the prefetches issued from the
        record. A rank that departs alone must not keep one and skip re-issuing it later (its
        collectives would then pair with different kinds of collectives on the other ranks and
        hang until the timeout); without it, the first unit that differs meets the tag check
        (checks.py) and fails with both units named."""
        prefetched, self._prefetched = self._prefetched, []
        for unit in prefetched:
            if unit.gather_in_flight:  # not used by the unit's gather since
                with engine_mode():
                    unit.discard_gather()
            self.live.change(unit.uid, 0, unit.gather_in_flight)
