"""`GradientSync`: gradient accumulation without communication (`ShardedModel.no_sync`,
`set_requires_gradient_sync`; FSDP2's `set_requires_gradient_sync(False)`, Lightning's
`no_backward_sync`). The driver (hooks.py) hands it every unit's whole gradients and the ends of
backward; it Reduce-Scatters them now (reduce.py) or adds them up.

[Note: unsynced accumulation]
While sync is off, a unit's post-backward adds its whole gradients into a buffer of its own, laid out as
the Reduce-Scatter input's (N, S) columns (unit.py, Note: flat layout), and sends nothing; persistent
parameters' gradients accumulate in `.grad`, their All-Reduce waiting too. (docs/design.md, unsynced
accumulation)

[Note: gradients owed]
    SYNCED --a backward with sync off ends--> OWED --the backward with sync on ends--> SYNCED
    SYNCED or OWED --a backward raised while sync was off or gradients were owed--> INCOMPLETE
    OWED or INCOMPLETE --discard()--> SYNCED
While OWED or INCOMPLETE, `optimizer.step()` of an optimizer holding the model's parameters
raises (a global step pre-hook, registered only then; a step given a closure, as Lightning's,
is checked after the closure's backward), as does every backward while INCOMPLETE: `.grad`
lacks micro-batches since the last sync. `optimizer.zero_grad()` cannot clear the buffers, so
it is caught: when a backward with sync off ends, every trainable shard of a summed unit has a
`.grad` (where it had none, a zero-stride zero: no memory) whose object and version are noted;
zero_grad replaces or zeroes it, and the next backward refuses to start (-> INCOMPLETE) rather
than add micro-batches one process would have cleared. The backward with sync on removes the
placeholders before its reductions land. Between unsynced backwards `.grad` reads zero.
"""

from __future__ import annotations

import weakref
from enum import Enum
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_zero3.engine.persistent import PersistentGrads
from lightning_zero3.engine.record import StepRecord
from lightning_zero3.engine.reduce import Reductions, Summed, grad_blocks
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.unit import Unit

__all__ = ["GradientSync", "SyncState"]


class SyncState(Enum):
    SYNCED = "nothing owed"
    OWED = "gradients accumulated locally, owed one reduction"
    INCOMPLETE = "a backward raised while accumulating"


_S = SyncState
LEGAL = {
    (_S.SYNCED, _S.OWED),
    (_S.OWED, _S.SYNCED),
    (_S.SYNCED, _S.INCOMPLETE),
    (_S.OWED, _S.INCOMPLETE),
    (_S.INCOMPLETE, _S.SYNCED),
}

FIX = (
    "Call `discard_unsynced_gradients()` on the ShardedModel that holds the module (a strategy's `sharded_model()`) "
    "and `optimizer.zero_grad()`, then start the accumulation again."
)
INCOMPLETE = (
    "A backward raised while gradients were accumulated with gradient sync off (`no_sync`, or a strategy's way to "
    "it), so the gradients of the micro-batches since the last sync are incomplete. " + FIX
)


class GradientSync:
    """Per unit, the whole gradients summed with sync off; reduces them, or each backward's."""

    def __init__(
        self, units: list[Unit], *, reductions: Reductions, persistent: PersistentGrads, record: StepRecord
    ) -> None:
        self.units = units
        self.reductions = reductions  # Reduce-Scatters in flight (reduce.py)
        self.persistent = persistent  # their All-Reduce waits for the sync too
        self.record = record  # counts the reductions (record.py)
        self.requires_sync = True  # the user's setting
        self.state = SyncState.SYNCED  # moved only by `_move` (Note: gradients owed)
        self._summed: dict[int, Summed] = {}  # unit id -> its gradients summed with sync off
        # id(shard param) -> (it, the `.grad` noted, its version, whether it is a placeholder).
        self._watched: dict[int, tuple[ShardedParam, torch.Tensor, int, bool]] = {}
        self._step_hook: Any = None  # the global optimizer-step pre-hook while owed
        self._began_unsynced = False  # whether the backward running began with sync off

    def _move(self, state: SyncState) -> None:
        assert (self.state, state) in LEGAL, f"ZeRO-3 internal error: sync {self.state.name} -> {state.name}"
        if state is _S.SYNCED:
            self._summed.clear()
            self._unwatch()
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
        elif self._step_hook is None:
            me = weakref.ref(self)  # the global hook must not keep the model alive
            self._step_hook = register_optimizer_step_pre_hook(lambda opt, *rest: _check_step(me, opt, *rest))
        self.state = state

    # ---- the driver's calls -----------------------------------------------------------------
    def begin_backward(self) -> bool:
        """A backward starts: refused while INCOMPLETE or after zero_grad while OWED. Returns
        whether it runs with sync off (its ranks may disagree: checks.py, Note: uneven batches)."""
        if self.state is _S.INCOMPLETE:
            raise RuntimeError(INCOMPLETE)
        self._began_unsynced = not self.requires_sync
        if self.state is not _S.OWED:
            return self._began_unsynced
        changed = [
            p.name
            for p, grad, version, _ in self._watched.values()
            if p.param.grad is not grad or grad._version != version
        ]
        if changed:
            self._move(_S.INCOMPLETE)
            self._summed.clear()
            raise RuntimeError(
                f"The gradients of {changed[:3]} were cleared or replaced (optimizer.zero_grad()?) while gradients "
                f"accumulated with gradient sync off were owed a reduction: those live in the engine's buffers, "
                f"which zero_grad cannot clear, so the result would not be what one process computes. Call "
                f"zero_grad only after the backward with sync on (and the optimizer step). " + FIX
            )
        if self.requires_sync:
            self._unwatch()  # the reductions assign or add into `.grad` from here
        return self._began_unsynced

    def reduce_or_add(self, unit: Unit, grads: list[torch.Tensor | None]) -> None:
        """`GatherParams.backward` has `unit`'s whole gradients: reduce them, or add them up."""
        summed = self._summed.get(unit.uid)
        if self.requires_sync and summed is None:
            self._reduce(unit, grads)  # the common case
            return
        summed = self._add(unit, grads, summed)
        if self.requires_sync:
            self._reduce(unit, self._summed.pop(unit.uid))

    def finish_reductions(self) -> None:
        """End of backward, before the tag check: with sync on, reduce the units still holding
        sums (Note: unsynced accumulation); then every shard gradient lands in `.grad`."""
        if self.requires_sync:
            for uid in sorted(self._summed):
                self._reduce(self.units[uid], self._summed.pop(uid))
        self.reductions.finish_all()

    def finish_backward(self) -> None:
        """End of backward, last: All-Reduce the persistent gradients, or leave them owed."""
        self.record.current.backwards += 1
        self.record.current.synced += self.requires_sync
        if self.requires_sync:
            self.persistent.reduce()
            if self.state is _S.OWED:
                self._move(_S.SYNCED)
        elif self._summed or any(p.requires_grad for p in self.persistent.params):
            self._watch()
            if self.state is _S.SYNCED:
                self._move(_S.OWED)

    def abandon(self) -> None:
        """A backward raised (hooks.py, Note: exceptions): its reductions are dropped, and so is
        whatever was accumulated, which is now incomplete."""
        self.reductions.drop_all()
        owed = self._began_unsynced or self._summed or self.state is _S.OWED  # the setting may have changed since
        if owed and self.state is not _S.INCOMPLETE:
            self._move(_S.INCOMPLETE)
            self._summed.clear()

    def discard(self) -> None:
        """Drop what was accumulated with sync off; the sync setting stays."""
        if self.state is not _S.SYNCED:
            self._move(_S.SYNCED)

    # ---- inside ---------------------------------------------------------------------------
    def _reduce(self, unit: Unit, grads: list[torch.Tensor | None] | Summed) -> None:
        self.reductions.start(unit, grads)
        self.record.add("reduced", unit.uid)

    def _add(self, unit: Unit, grads: list[torch.Tensor | None], summed: Summed | None) -> Summed:
        if summed is None:
            dtype = torch.promote_types(unit.reduce_dtype, torch.float32)  # Note: unsynced accumulation
            total = torch.zeros(unit.world_size, unit.shard_numel, dtype=dtype, device=unit.device)  # (N, S)
            summed = self._summed[unit.uid] = Summed(total, [False] * len(unit.params))
        grads = [g if p.requires_grad else None for g, p in zip(grads, unit.params)]
        with torch.no_grad():
            for i, (p, offset, block) in enumerate(zip(unit.params, unit.offsets, grad_blocks(unit, grads))):
                if block is not None:
                    summed.total[:, offset : offset + p.shard_numel].add_(block)
                    summed.present[i] = True
        return summed

    def _watch(self) -> None:
        """Note each summed unit's trainable shards' `.grad` (Note: gradients owed)."""
        for uid in self._summed:
            for p in self.units[uid].params:
                if not p.requires_grad or id(p) in self._watched:
                    continue
                grad, placeholder = p.param.grad, p.param.grad is None
                if grad is None:
                    grad = torch.zeros((), dtype=p.param.dtype, device=p.param.device).expand(p.shard_numel)
                    p.param.grad = grad
                self._watched[id(p)] = (p, grad, grad._version, placeholder)

    def _unwatch(self) -> None:
        for p, grad, _, placeholder in self._watched.values():
            if placeholder and p.param.grad is grad:
                p.param.grad = None
        self._watched.clear()

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        mine = {id(p.param) for u in self.units for p in u.params} | {id(p) for p in self.persistent.params}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

    def _refuse_step(self) -> None:
        if self.state is not _S.SYNCED:
            what = "are incomplete (a backward raised)" if self.state is _S.INCOMPLETE else "have not been reduced"
            raise RuntimeError(
                f"optimizer.step() while the gradients accumulated with gradient sync off {what}: `.grad` does not "
                f"hold them yet. Run the last micro-batch's backward with sync on (outside no_sync / "
                f"no_backward_sync) before the step. Or, to drop them: " + FIX
            )


def _check_step(me: weakref.ref[GradientSync], optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    """The optimizer-step pre-hook while gradients are owed (Note: gradients owed). A step given
    a closure (Lightning's) runs its forward and backward first: checked after the closure."""
    sync = me()
    if sync is None or not sync._holds(optimizer):
        return None
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
    if closure is None:
        sync._refuse_step()
        return None

    def checked() -> Any:
        loss = closure()
        sync._refuse_step()
        return loss

    return ((args[0], checked, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "closure": checked})
