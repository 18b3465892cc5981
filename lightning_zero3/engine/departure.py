"""Departure notices: a rank about to leave the recorded unit order says so in the collective
the others issue next (checks.py, Note: deferred tag checks), so that no rank meets a
collective of an unexpected size and every rank raises `OrderMismatchError` naming the unit."""

from __future__ import annotations

from collections.abc import Callable

from lightning_zero3.engine.checks import OrderMismatchError, RankChecks
from lightning_zero3.engine.schedule import Schedule
from lightning_zero3.engine.unit import Unit


def announce_departure(
    unit: Unit, units: list[Unit], schedule: Schedule, checks: RankChecks, *, backward: bool,
    kept: Callable[[Unit], bool],
) -> None:  # fmt: skip
    """Called before `unit` is gathered. If running it leaves the recorded order, watch closely
    from now on, and join the All-Gather the ranks that still follow the record issue next,
    with a tag saying which unit this rank runs instead. If every rank departed alike, carry on
    (a changed order is legal when all agree); otherwise raise, while the others find the
    marked tag at their next check or failure. Nothing on a step the checks skip (checks.py,
    Note: rank check modes)."""
    position = schedule.departure(unit.uid, backward=backward)
    if position is None or not checks.active:
        return
    checks.closely = True
    checks.check()
    order = schedule.backward_order if backward else schedule.forward_order
    assert order is not None
    # What a rank on the record gathers next: the unit itself at the start of a pass or
    # without prefetch, else the unit `prefetch` places ahead.
    ahead = position if position == 0 or schedule.prefetch == 0 else position + schedule.prefetch
    if backward:
        # Units kept from forward into backward are never gathered there (hooks.py, Note: kept
        # for backward): the others' next gather is the first unit after them. This rank kept
        # what they kept (its forward followed the same record) and has not reached them yet.
        while ahead < len(order) and kept(units[order[ahead]]):
            ahead += 1
    if ahead >= len(order):
        return  # nothing predictable: the tag checks at the next collectives must do
    expected = units[order[ahead]]
    # A unit this rank holds may still be what the others gather next: an outer unit open at
    # `position` and called again right after it (their prefetch skips it, their next gather is
    # its own). So holding it is no reason to skip the notice (tests/test_engine_tags.py).
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
            f"'{units[order[position]].name}' (the ranks' All-Gather tags: [{where}]). Every rank "
            f"must run the same units in the same order each step; data-dependent control flow is not "
            f"supported under ZeRO-3. Make the branch decision identical on all ranks."
        )
