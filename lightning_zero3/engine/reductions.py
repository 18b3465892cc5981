"""The Reduce-Scatters of a backward while they are in flight, and adding their results into
the shards' `.grad`. `HookDriver` (hooks.py) starts one per unit call and drains them when the
backward ends (or drops them when it raised).

[Note: asynchronous reduction]
`GatherParams.backward` only starts a unit's Reduce-Scatter and returns no gradient to autograd;
the backward of the next unit computes while it is in flight. The reduced shard gradients are
added into `shard.grad` by the engine when the reduction is waited for: once more than
`ShardedModel(reductions_in_flight=k)` are pending (default 0: at once), and for all of them in
the callback that ends backward, so `.grad` is complete when `backward()` returns. A rank that
runs different units than the others announces its departure before its next gather (tags.py,
Note: deferred tag checks), so every rank raises the error naming the unit (where the others'
next collective cannot be predicted from the record, gloo may still abort that rank). Adding
(rather than assigning) keeps accumulation, tied weights and modules called twice exact.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from lightning_zero3.engine.reduce import PendingReduce
from lightning_zero3.engine.unit import Unit

if TYPE_CHECKING:
    from lightning_zero3.engine.model import ShardedModel


class Reductions:
    """Reduce-Scatters in flight, oldest first."""

    def __init__(self, model: ShardedModel) -> None:
        self.model = model  # its `reductions_in_flight` is how many may stay in flight
        self._in_flight: deque[tuple[Unit, PendingReduce]] = deque()

    def start(self, unit: Unit, grads: list[torch.Tensor | None]) -> None:
        """Start reducing `unit`'s full gradients (None for frozen parameters); wait for the
        oldest ones while more than `reductions_in_flight` are pending."""
        with torch.profiler.record_function(f"ZeRO3::reduce_grads({unit.name})"):
            grads = [g if p.requires_grad else None for g, p in zip(grads, unit.params)]
            self._in_flight.append((unit, unit.start_reduce(grads)))
            while len(self._in_flight) > self.model.reductions_in_flight:
                self._finish_oldest()

    def finish_all(self) -> None:
        """The backward is over: every shard gradient goes into `.grad`."""
        while self._in_flight:
            self._finish_oldest()

    def drop_all(self) -> None:
        """A backward that raised (hooks.py, Note: exceptions): the collectives complete, their
        gradients are dropped."""
        while self._in_flight:
            unit, pending = self._in_flight.popleft()
            unit.finish_reduce(pending)

    def _finish_oldest(self) -> None:
        """Wait for the oldest Reduce-Scatter and add its shard gradients into `.grad`."""
        unit, pending = self._in_flight.popleft()
        with torch.profiler.record_function(f"ZeRO3::wait_reduce({unit.name})"):
            shard_grads = unit.finish_reduce(pending)
        for sharded, grad in zip(unit.params, shard_grads):
            if grad is None:
                continue
            if sharded.param.grad is None:
                sharded.param.grad = grad  # a view of the unit's reduced buffer: no copy
            else:
                sharded.param.grad.add_(grad)
