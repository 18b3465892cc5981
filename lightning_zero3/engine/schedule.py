"""Execution-order recording and prefetch decisions. The first pass records the order in which
units run forward (a pass without backward too, while nothing is recorded), the first backward
the order their backwards start; then each unit that starts has the next `prefetch` units of the
record gathered ahead. A pass that departs from the record stops prefetching (dropping what it
issued) and becomes the new record. Ranks compare records once, after the first backward.
"""

from __future__ import annotations

from lightning_zero3.engine.calls import CallTable, engine_mode
from lightning_zero3.engine.record import UnitStats
from lightning_zero3.engine.unit import Unit


class _Phase:
    """One direction's record (None: nothing recorded) and the pass in progress against it."""

    def __init__(self) -> None:
        self.order: list[int] | None = None
        self.seen: list[int] = []
        self.on_track = True  # the pass still follows the record (prefetch only while it does)

    def begin(self) -> None:
        self.seen = []
        self.on_track = True

    def advance(self, uid: int, count: int) -> list[int]:
        """Record that unit `uid` starts; the `count` units to prefetch now."""
        position, order = len(self.seen), self.order
        self.seen.append(uid)
        if order is None or not self.on_track or position >= len(order) or order[position] != uid:
            self.on_track = False  # for the rest of the pass, whatever `count` (prefetch=0 too)
            return []
        return order[position + 1 : position + 1 + count]

    def adopt(self) -> None:
        """The pass just finished becomes the record if it differs from it."""
        if self.seen and self.seen != self.order:
            self.order = list(self.seen)


class Schedule:
    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.forward, self.backward = _Phase(), _Phase()

    @property
    def forward_order(self) -> list[int] | None:
        return self.forward.order

    @property
    def backward_order(self) -> list[int] | None:
        return self.backward.order

    @property
    def forward_complete(self) -> bool:
        """Whether the forward in progress has run the whole record (and no more)."""
        order = self.forward.order
        return self.forward.on_track and order is not None and len(self.forward.seen) == len(order)

    def departure(self, uid: int, *, backward: bool) -> int | None:
        """The position at which running unit `uid` next would leave the record, or None if it
        follows the record (or the pass has left it already, or none exists)."""
        phase = self.backward if backward else self.forward
        if phase.order is None or not phase.on_track:
            return None
        position = len(phase.seen)
        return None if position < len(phase.order) and phase.order[position] == uid else position

    def end_forward(self) -> None:
        """With nothing recorded yet, the forward just ended becomes the record, so evaluation and
        generation before any training step prefetch from their second pass on."""
        if self.forward.order is None and self.forward.seen:
            self.forward.order = list(self.forward.seen)

    def end_backward(self) -> None:
        self.forward.adopt()
        self.backward.adopt()


class Prefetcher:
    """The gathers issued ahead of the units that run next in the record."""

    def __init__(self, units: list[Unit], *, schedule: Schedule, calls: CallTable, live: UnitStats) -> None:
        self.units = units
        self.schedule = schedule
        self.calls = calls  # a unit on its modules or kept needs no prefetch
        self.live = live
        self._prefetched: list[Unit] = []  # some may have been used since

    def ahead(self, unit: Unit, *, backward: bool) -> None:
        """`unit` starts: gather the units the record says come next, or drop the prefetches if it
        just left the record."""
        phase = self.schedule.backward if backward else self.schedule.forward
        on_track = phase.on_track
        for ahead in phase.advance(unit.uid, self.schedule.prefetch):
            self._prefetch(self.units[ahead])
        if on_track and not phase.on_track:
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
        """Drop the prefetches issued from the record. A rank that departs alone must not keep one
        and skip re-issuing it later (its collectives would pair wrongly and hang); without it,
        the first unit that differs meets the tag check with both units named."""
        prefetched, self._prefetched = self._prefetched, []
        for unit in prefetched:
            if unit.gather_in_flight:  # not used by the unit's gather since
                with engine_mode():
                    unit.discard_gather()
            self.live.change(unit.uid, 0, unit.gather_in_flight)
