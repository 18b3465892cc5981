"""What the engine did, counted where it does it (accounting.py is the oracle): `StepRecord`, per
step, which units it gathered, kept and reduced; `UnitStats`, the units holding whole parameters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# The recorded (forward, backward) unit orders a step ran with (schedule.py).
Orders = tuple[list[int] | None, list[int] | None]


@dataclass
class Step:
    """Per kind, unit id -> times; and the recorded orders the step ran with."""

    gathered: Counter[int] = field(default_factory=Counter)
    kept: Counter[int] = field(default_factory=Counter)
    reduced: Counter[int] = field(default_factory=Counter)
    kept_slice: Counter[int] = field(default_factory=Counter)  # reshard_after_forward=G (reshard.py)
    gathered_slice: Counter[int] = field(default_factory=Counter)
    orders: Orders = (None, None)
    backwards: int = 0  # backward passes (micro-batches) that ended in the step
    synced: int = 0  # of which reduced their gradients (accumulate.py)


class StepRecord:
    def __init__(self) -> None:
        self.current = Step()
        self.last: Step | None = None

    def add(self, kind: str, uid: int) -> None:
        getattr(self.current, kind)[uid] += 1

    def end_step(self) -> None:
        """Close the step; `orders` carry over until the driver's next pass sets them."""
        self.last, self.current = self.current, Step(orders=self.current.orders)


@dataclass
class UnitStats:
    """Units holding whole parameters (or a gather in flight) now, and the peak."""

    alive: int = 0
    peak: int = 0
    peak_without_root: int = 0
    _calls: Counter[int] = field(default_factory=Counter, init=False, repr=False)  # holding whole parameters
    _alive: set[int] = field(default_factory=set, init=False, repr=False)

    def change(self, uid: int, delta: int, gather_in_flight: bool) -> None:
        """Unit `uid` gained (+1) or lost (-1) a call holding whole parameters, or (0) a gather."""
        self._calls[uid] += delta
        if self._calls[uid] > 0 or gather_in_flight:
            self._alive.add(uid)
        else:
            self._alive.discard(uid)
        self.alive = len(self._alive)
        self.peak = max(self.peak, self.alive)
        self.peak_without_root = max(self.peak_without_root, self.alive - (0 in self._alive))

    def reset_peaks(self) -> None:
        self.peak = self.alive
        self.peak_without_root = self.alive - (0 in self._alive)


__all__ = ["Orders", "Step", "StepRecord", "UnitStats"]
