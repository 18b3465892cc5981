"""Forward and backward hooks that drive units (calls.py: call and pass states, `GatherParams`;
kept.py: inference; reduce.py: reductions in flight). The driver never reaches back into the model.

[Note: one unit call]
Each forward of a unit gathers its shards (through `GatherParams` when gradients will flow). The
whole tensors shadow the shards as instance attributes (`module.__dict__[name]`) during forward;
then their storage is freed while autograd keeps the objects, and a hook on the outputs gathers
again into it before the unit's backward. `GatherParams.backward` reduces the whole gradients and
adds each rank's piece into `shard.grad`: accumulation, tied weights and reused modules are exact.

[Note: kept for backward]
Backward begins with the units that ended the forward: the root (when it closes the pass) and, once the
forward ran the whole record, its last unit. (docs/design.md, kept for backward)

[Note: frozen units]
A unit without a trainable parameter still runs backward when its input needs a gradient (LoRA),
with its whole weights saved by autograd and no `GatherParams.backward` to say when that is over.
A hook on those inputs (`register_multi_grad_hook`: it fires once they have their gradients, so
after every node that reads the weights; hooked rather than wrapped: a module may modify an
identity Function's outputs in place) releases them; an unhooked one is released when backward ends.

[Note: exceptions]
A forward that raises still runs its units' post-forward hooks (`always_call`); a pre-forward
that raises opens nothing. A backward that raises never runs its end callback: the next forward
outside autograd's engine closes it (`_abandon_backward`: reductions dropped, re-gathered memory
freed; `.grad` holds what finished units added: zero it). Autograd's state comes from the
private `torch._C._current_graph_task_id()` (torch's checkpoint and FSDP2 use it; tried on 2.13);
where it is missing, a backward that raised stays open.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten  # private: Note below the imports

from lightning_zero3.engine.accumulate import GradientSync
from lightning_zero3.engine.calls import (
    DEEPCOPY_REFUSED,
    PASS_LEGAL,
    PICKLE_REFUSED,
    CallTable,
    GatherParams,
    UnitCall,
    autograd_running,
    eager,
    engine_mode,
)
from lightning_zero3.engine.calls import CallState as S
from lightning_zero3.engine.calls import PassState as P
from lightning_zero3.engine.checks import OrderMismatchError, RankChecks
from lightning_zero3.engine.comm import CollectiveError, Comm
from lightning_zero3.engine.departure import announce_departure
from lightning_zero3.engine.kept import UNSYNCED_HINT, KeptUnits
from lightning_zero3.engine.persistent import PersistentGrads
from lightning_zero3.engine.record import StepRecord, UnitStats
from lightning_zero3.engine.reshard import after_forward
from lightning_zero3.engine.schedule import Prefetcher, Schedule
from lightning_zero3.engine.unit import ShardSource, Unit

# `torch.utils._pytree` is private (torch 2.13 has no public one): FSDP2 flattens hook arguments
# with it and transformers registers its ModelOutput there. No fallback.


class HookDriver:
    """Installs the hooks on the unit modules and runs the unit life cycle."""

    def __deepcopy__(self, memo: dict) -> HookDriver:  # reached through the hooks (an EMA teacher)
        raise TypeError(DEEPCOPY_REFUSED)

    def __reduce_ex__(self, protocol: object) -> Any:  # reached through the hooks (torch.save(trainer))
        raise TypeError(PICKLE_REFUSED)

    def __init__(
        self,
        units: list[Unit],
        *,
        schedule: Schedule,
        checks: RankChecks,
        grads: GradientSync,
        persistent: PersistentGrads,
        live: UnitStats,
        record: StepRecord,
        world_comm: Comm,
        reshard: bool | int,
        offload: ShardSource | None,
    ) -> None:
        self.units = units
        self.schedule = schedule
        self.checks = checks
        self.grads = grads
        self.record = record
        self.world_comm = world_comm  # the first step's order comparison runs on it
        self.reshard = reshard  # resolved (reshard.py)
        self.offload = offload  # refreshed when a pass begins (offload.py, Note: host offload)
        self.state = P.IDLE
        self.calls = CallTable(units, live=live, record=record)
        self.prefetch = Prefetcher(units, schedule=schedule, calls=self.calls, live=live)
        self._pending: list[UnitCall] = []  # calls of this pass that may still get a backward
        self.kept = KeptUnits()
        self.handles: list[Any] = []
        root = units[0]
        for unit in units:
            if not unit.params and unit is not root:
                continue  # the root is hooked even without parameters: it frames the pass
            modules = [unit.module]
            if unit is root:  # Note: root parameters outside the root's forward
                owners = {id(m): m for p in root.params for m, _ in p.owners if m is not root.module}
                modules += owners.values()
            for module in modules:
                pre, post = partial(self._pre_forward, unit), partial(self._post_forward, unit)
                self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                self.handles.append(module.register_forward_hook(post, always_call=True))
        # With every trainable parameter persistent no pre-backward runs: their gradients start it.
        for param in persistent.params:
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._on_persistent_grad))

    def remove(self) -> None:
        """Close the calls still holding whole parameters, then remove the hooks. No collective:
        leave_sharded may follow a failure where ranks are gone."""
        self.calls.drop_leftovers()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ---- the one place where the pass changes state (calls.py, PassState) -----------------
    def _enter(self, state: P) -> None:
        assert (self.state, state) in PASS_LEGAL, f"ZeRO-3 internal error: pass {self.state.name} -> {state.name}"
        self.state = state

    def _leave(self) -> None:
        self._enter(P.FORWARD if self.calls.open else P.IDLE)

    # ---- forward ----------------------------------------------------------------------------
    def _gather_call(self, unit: Unit) -> UnitCall:
        reduces = torch.is_grad_enabled() and any(p.requires_grad for p in unit.params)
        call = UnitCall(unit, reduces=reduces)
        with torch.profiler.record_function(f"ZeRO3::gather({unit.name})"):
            if reduces:
                call.wholes = list(GatherParams.apply(self.post_backward, call, *(p.param for p in unit.params)))
            else:
                with engine_mode():
                    call.wholes = unit.gather()
        call.versions = unit.versions()
        self.calls.move(call, S.FORWARD)
        return call

    @eager
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        slot = self.calls.slots[unit.uid]
        if self.state is P.KEPT:
            self.kept.check_forward(unit, slot, unit.versions())
            self.calls.set_depth(slot, slot.depth + 1)
            return None
        current = slot.call
        backward = self.state is P.BACKWARD
        if backward and current is not None and current.state is S.BACKWARD:
            # Non-reentrant recomputation reuses the re-gathered parameters; it may be cut short,
            # so no post-forward is owed: the depth stays 0 (calls.py, Note: recomputation).
            return None
        if slot.depth:
            self.calls.set_depth(slot, slot.depth + 1)  # re-entered (self(x) inside training_step): already whole
            if current is not None and (current.state is S.REDUCED_IN_FORWARD or current.versions != unit.versions()):
                # Stale (an optimizer step inside training_step); a backward still owed keeps its tensors.
                self.calls.move(current, S.DONE)
                self._gather_call(unit)
            return None
        if backward and not autograd_running():
            self._abandon_backward()
            backward = False
        if self.state is P.IDLE:
            self._begin_pass()
        call = None  # a root without parameters gathers nothing: it opens the pass and prefetches
        try:
            if unit.params:
                if not backward:  # departure notice (departure.py)
                    announce_departure(
                        unit, self.units, self.schedule, self.checks, backward=False, kept=self.calls.is_kept
                    )
                call = self._gather_call(unit)
        except (CollectiveError, OrderMismatchError) as err:
            if torch.is_grad_enabled() or backward:
                raise
            raise type(err)(f"{err} {UNSYNCED_HINT}") from err  # kept.py, Note: kept for inference
        self.calls.set_depth(slot, 1)  # last: a pre-forward that raised opens nothing (Note: exceptions)
        if not backward:  # evaluation passes prefetch too
            self.prefetch.ahead(unit, backward=False)
        if call is not None and not call.reduces and torch.is_grad_enabled():
            self._hook_inputs(call, args, kwargs)
        return None

    def _hook_inputs(self, call: UnitCall, args: Any, kwargs: Any) -> None:
        """Note: frozen units. The hook holds the call weakly (calls.py, Note: call lifetime)."""
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, partial(self._after_input_grads, weakref.ref(call)), mode="all")

    @eager
    def _after_input_grads(self, call_ref: weakref.ref[UnitCall], grads: Any) -> None:
        call = call_ref()
        if call is not None and call.state is S.BACKWARD:
            self.calls.move(call, S.DONE)

    @eager
    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        slot = self.calls.slots[unit.uid]
        if self.state is P.KEPT:
            self.calls.set_depth(slot, max(slot.depth - 1, 0))  # the call stays in FORWARD
            return
        if not slot.depth:  # end of a recomputation (see _pre_forward), or a pre-forward that raised
            if self.state is P.FORWARD and not self.calls.open:
                self._enter(P.IDLE)  # the raising pre-forward had begun the pass
            return
        self.calls.set_depth(slot, slot.depth - 1)
        if slot.depth:
            return
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.state is P.FORWARD and not self.calls.open:  # the pass's forward is over (or raised)
            self._enter(P.IDLE)
            self.schedule.end_forward()
            self.prefetch.drop_stale()
            if not outputs:
                self.calls.release_kept()
        if slot.call is None:
            return
        call = slot.call
        if call.state is not S.FORWARD or not outputs:  # no backward owed
            self.calls.move(call, S.DONE)
            return
        after_forward(self.reshard, call, self.calls, ends_forward=self._ends_forward(unit))
        self._pending.append(call)
        for tensor in outputs:
            tensor.register_hook(partial(self._pre_backward, call))

    def _ends_forward(self, unit: Unit) -> bool:  # Note: kept for backward
        return self.state is not P.BACKWARD and (
            (unit is self.units[0] and not self.calls.open) or self.schedule.forward_complete
        )

    def _begin_pass(self, state: P = P.FORWARD) -> None:
        """A unit starts forward (or every unit is kept) with nothing open, no backward running."""
        self.checks.check_soon()  # tags left by a pass without backward, or by the last step (checks.py)
        self.checks.closely = self.schedule.forward_order is None  # watch closely until a record exists
        if self.offload is not None:
            self.offload.begin_pass()
        # Prefetches may predate an optimizer step; a call still on its modules is a leftover of a
        # pass that raised (Note: exceptions).
        self.prefetch.drop_stale()
        self.calls.drop_leftovers()
        self._pending = []
        self.schedule.forward.begin()
        self.record.current.orders = (self.schedule.forward_order, self.schedule.backward_order)
        self._enter(state)

    # ---- kept for inference (kept.py) -------------------------------------------------------
    def keep(self) -> None:
        """Gather every unit until `release` (kept.py). Collective."""
        open_calls = [s.call for s, u in zip(self.calls.slots, self.units) if s.depth and u.params]
        self.kept.refuse_entry(self.state, open_calls)
        if self.state is P.BACKWARD:
            self._abandon_backward()  # autograd is not running it: a backward that raised
        if self.calls.open:  # inside a forward: its units keep their calls
            self.prefetch.drop_stale()
            self._enter(P.KEPT)
        else:
            self._begin_pass(P.KEPT)
        self.kept.depths = [slot.depth for slot in self.calls.slots]
        try:
            with torch.no_grad():  # reduces=False: the kept tensors have no autograd parent
                for unit, slot in zip(self.units, self.calls.slots):
                    if unit.params and slot.call is None:
                        self.kept.calls.append(self._gather_call(unit))
            self.checks.check()  # outside any pass: check the tags of these gathers now
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Every call `keep` gathered goes to DONE (an enclosing forward's stay for its hooks)."""
        calls, self.kept.calls = self.kept.calls, []
        for call in calls:
            if call.state is S.FORWARD:
                self.calls.move(call, S.DONE)
        for slot, depth in zip(self.calls.slots, self.kept.depths):
            self.calls.set_depth(slot, depth)
        self._leave()

    # ---- backward ---------------------------------------------------------------------------
    def _ensure_backward_started(self) -> None:
        self.kept.refuse_backward(self.state)
        if self.state is P.BACKWARD:
            return
        if self.grads.begin_backward():  # sync off: the forward's tags first (checks.py, Note: uneven batches)
            self.checks.check()
        self._enter(P.BACKWARD)
        self.schedule.backward.begin()
        Variable._execution_engine.queue_callback(self._end_backward)

    @eager
    def _on_persistent_grad(self, param: torch.Tensor) -> None:
        self._ensure_backward_started()

    @eager
    def _pre_backward(self, call: UnitCall, grad: torch.Tensor) -> None:
        if call.state not in (S.RESHARDED, S.KEPT, S.DONE) or not call.wholes:
            return  # gathered already, or a call that owes no backward
        self._ensure_backward_started()
        unit = call.unit
        with torch.profiler.record_function(f"ZeRO3::pre_backward({unit.name})"):
            if call.state is not S.KEPT:  # a kept call is whole already (Note: kept for backward)
                if call.state is S.DONE:
                    self._pending.append(call)  # a second backward through a retained graph
                announce_departure(unit, self.units, self.schedule, self.checks, backward=True, kept=self.calls.is_kept)
                with engine_mode():
                    unit.gather(into=call.wholes)
            self.calls.move(call, S.BACKWARD)
            self.prefetch.ahead(unit, backward=True)

    @eager
    def post_backward(self, call: UnitCall, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """`GatherParams.backward`: start the reduction, return no gradient (reduce.py)."""
        self._ensure_backward_started()
        unit = call.unit
        self.grads.reduce_or_add(unit, grads)
        if call.state is S.FORWARD:
            self.calls.move(call, S.REDUCED_IN_FORWARD)  # tensors stay on the modules until forward ends
        elif call.state is S.BACKWARD:
            self.calls.move(call, S.DONE)
        return [None] * len(unit.params)

    def _abandon_backward(self) -> None:
        """Close a backward that raised (Note: exceptions)."""
        self.grads.abandon()
        for slot in self.calls.slots:
            if slot.call is not None and slot.call.state is S.BACKWARD:
                self.calls.move(slot.call, S.DONE)
        self._close_pending()
        self._leave()

    @eager
    def _end_backward(self) -> None:
        self.grads.finish_reductions()
        self.checks.check_soon()  # no host sync: read when landed (checks.py, Note: deferred tag checks)
        self._close_pending()
        self.grads.finish_backward()  # the persistent gradients' All-Reduce, unless sync is off
        self.schedule.end_backward()
        self._leave()
        if self.checks.steps == 0:  # the first step's record, once
            orders = self.schedule.forward_order or [], self.schedule.backward_order or []
            self.checks.agree_on_orders(self.world_comm, *orders)
        self.checks.step_done()

    def _close_pending(self) -> None:
        """End of a backward: close the calls it did not finish (outputs that never reached the
        loss, frozen calls, a backward that raised); drop prefetches."""
        for call in self._pending:
            if call.state in (S.BACKWARD, S.RESHARDED, S.KEPT):
                self.calls.move(call, S.DONE)
        self._pending = []
        self.prefetch.drop_stale()
