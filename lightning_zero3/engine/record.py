"""What the engine did, counted where it does it: `StepRecord`, per step, which units it
All-Gathered, kept gathered from forward into backward, and Reduce-Scattered, and with
`reshard_after_forward=G` which kept a 1/G slice and gathered it inside its group of G (the one source of
truth; accounting.py's formula is the oracle tests and docs/accounting.md check it against);
`LiveUnits`, how many units hold full parameters now and at the peak."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

KINDS = ("gathered", "kept", "reduced", "kept_slice", "gathered_slice")

# The recorded (forward, backward) unit orders a step ran with (schedule.py).
Orders = tuple[list[int] | None, list[int] | None]


@dataclass
class Step:
    """One step's record: per kind, unit id -> times; and the recorded orders it ran with."""

    gathered: Counter[int] = field(default_factory=Counter)
    kept: Counter[int] = field(default_factory=Counter)
    reduced: Counter[int] = field(default_factory=Counter)
    kept_slice: Counter[int] = field(default_factory=Counter)  # reshard_after_forward=G (reshard.py)
    gathered_slice: Counter[int] = field(default_factory=Counter)  # All-Gathers inside the group of G
    orders: Orders = (None, None)
    backwards: int = 0  # backward passes (micro-batches) that ended in the step
    synced: int = 0  # of which reduced their gradients (accumulate.py)


class StepRecord:
    """The step in progress (`current`) and the last one closed (`last`, None before any)."""

    def __init__(self) -> None:
        self.current = Step()
        self.last: Step | None = None

    def add(self, kind: str, uid: int) -> None:
        getattr(self.current, kind)[uid] += 1

    def end_step(self) -> None:
        """Close the step. Its `orders` are those the driver saw when its last pass began."""
        self.last, self.current = self.current, Step(orders=self.current.orders)


@dataclass
class UnitStats:
    """How many units hold full parameters (or an in-flight gather) now, and the peak."""

    alive: int = 0
    peak: int = 0
    # The peak not counting the root unit, which is whole for the entire forward and backward.
    peak_without_root: int = 0


class LiveUnits:
    """Calls holding full parameters, per unit, and the units holding some or with a gather in
    flight, counted into `stats`."""

    def __init__(self, units: int, stats: UnitStats) -> None:
        self.calls = [0] * units
        self._alive: set[int] = set()
        self.stats = stats

    def change(self, uid: int, delta: int, gather_in_flight: bool) -> None:
        """Unit `uid` gained (+1) or lost (-1) a call holding full parameters, or a gather in
        flight was issued or dropped (0): only its membership of the alive set changes."""
        self.calls[uid] += delta
        if self.calls[uid] > 0 or gather_in_flight:
            self._alive.add(uid)
        else:
            self._alive.discard(uid)
        s = self.stats
        s.alive = len(self._alive)
        s.peak = max(s.peak, s.alive)
        s.peak_without_root = max(s.peak_without_root, s.alive - (0 in self._alive))

    def reset_peaks(self) -> None:
        self.stats.peak = self.stats.alive
        self.stats.peak_without_root = self.stats.alive - (0 in self._alive)


__all__ = ["KINDS", "LiveUnits", "Orders", "Step", "StepRecord", "UnitStats"]
