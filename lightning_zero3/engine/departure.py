"""Departure notices (checks.py, Note: deferred tag checks)."""

from __future__ import annotations

from collections.abc import Callable

from lightning_zero3.engine.checks import AGREE, OrderMismatchError, RankChecks
from lightning_zero3.engine.schedule import Schedule
from lightning_zero3.engine.unit import Unit


def announce_departure(
    unit: Unit,
    units: list[Unit],
    schedule: Schedule,
    checks: RankChecks,
    *,
    backward: bool,
    kept: Callable[[Unit], bool],
) -> None:
    """Before `unit` is gathered: if it leaves the record, join the All-Gather the ranks on the
    record issue next with a tag naming `unit`; raise unless every rank departed alike."""
    position = schedule.departure(unit.uid, backward=backward)
    if position is None or not checks.active:
        return
    checks.closely = True
    checks.check()
    order = schedule.backward_order if backward else schedule.forward_order
    assert order is not None
    # What a rank on the record gathers next: the unit itself at the start of a pass or
    # without prefetch, else the unit `prefetch` places ahead; in backward, past the kept units
    # (never gathered there; this rank kept what they kept).
    ahead = position if position == 0 or schedule.prefetch == 0 else position + schedule.prefetch
    if backward:
        while ahead < len(order) and kept(units[order[ahead]]):
            ahead += 1
    if ahead >= len(order):
        return  # nothing predictable: the tag checks at the next collectives must do
    expected = units[order[ahead]]
    # A unit this rank holds may still be what the others gather next (an outer unit called again
    # right after `position`): holding it is no reason to skip the notice (tests/engine/test_engine_tags.py).
    if not expected.params or expected.gather_in_flight:
        return
    notice = checks.tag(unit.uid, notice=True)
    tags = expected.announce(notice)
    if tags != [notice] * len(tags):
        where = ", ".join(f"rank {r}: {checks.describe_tag(t)}" for r, t in enumerate(tags))
        phase = "backward" if backward else "forward"
        raise OrderMismatchError(
            f"Order mismatch on rank {checks.rank}: at {phase} position {position} this rank ran unit "
            f"'{unit.name}' where the recorded order, which the other ranks followed, has "
            f"'{units[order[position]].name}' (the ranks' All-Gather tags: [{where}]). {AGREE}"
        )
