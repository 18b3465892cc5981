"""Forward and backward hooks that drive units. All autograd plumbing lives in this file and
in calls.py (the state of one unit call and its autograd Functions); held.py holds units
gathered across passes for inference, reductions.py the Reduce-Scatters in flight.

[Note: one unit call]
Each time a unit's module runs forward, its shards are gathered into full tensors (one
All-Gather); with a trainable parameter and gradients enabled, `GatherParams` does it and
becomes their autograd parent. The full tensors are set on the modules as instance attributes
that shadow the registered shard parameters (`module.__dict__[name]`), so the module's own
forward code reads them unchanged, and removed after forward; their storage is freed but the
tensor objects survive inside autograd's saved tensors. A hook on the unit's outputs fires when
their gradient arrives, before the unit's own backward runs, and gathers again into the same
storage. When autograd has every full parameter's gradient it calls `GatherParams.backward`,
which Reduce-Scatters them; each rank's averaged shard gradient is added into `shard.grad`
(reductions.py, Note: asynchronous reduction). One call, one reduction, added up: that is what makes
accumulation, tied weights and modules called twice exact without special cases.

[Note: kept for backward]
Backward begins with the units that ended the forward: the root (the LM head, the final norm)
and the last unit of the recorded forward order. Releasing them at their post-forward only to
gather them again when backward begins costs one All-Gather each per step and frees nothing
that matters: the memory is back before anything else is released. So a post-forward that
closes a call owing a backward moves it to KEPT when its unit is the root and it closes the
pass (a root layer called inside another unit's forward, outside the root's own, is followed
by the rest of that forward), or when the forward has run the whole recorded order
(`Schedule.forward_complete`); either happens at most once per unit and pass. The tensors leave
the modules (outside its forward a module shows its shards, as every unit does) but keep their
storage, and the pre-backward puts them back without a collective. FSDP2 keeps its root this
way (reshard_after_forward=False); torchtitan does so for its last block as well. Every rank
decides alike: the root is the same unit everywhere, the nesting of calls and the record are
the same on every rank (schedule.py). A kept call whose backward does not follow gives its
memory back: when a new pass begins (KEPT -> RESHARDED, its backward would gather again), when
the forward ends with nothing that needs a gradient (an exception caught mid-forward), when the
hooks are removed, or when a backward ends without reaching it (KEPT -> DONE). All-Gather
bytes per step: 2Ψ - Ψ_root - Ψ_last instead of 2Ψ.

[Note: frozen units]
A unit without a trainable parameter still runs backward whenever its input needs a gradient
(LoRA, partial fine-tuning), and autograd saves its full weights for that. It is released after
forward and re-gathered by the output hook like any other unit, but no `GatherParams.backward`
tells when its backward is over. A hook on its tensor inputs that need a gradient does
(`torch.autograd.graph.register_multi_grad_hook`): it fires once autograd has their gradients,
i.e. after every node of the unit that reads the weights, and releases them; no Reduce-Scatter.
The inputs are hooked, not wrapped (an identity Function's outputs could not be modified in
place by the module). An input also used after the unit (a skip connection over several units)
delays the release to its last use. A frozen unit whose outputs need a gradient that its inputs
do not (the root unit fed token ids) is released by the callback that ends backward.

[Note: exceptions]
A forward that raises (out of memory in a block, caught by a `try`) still runs the post-forward
hooks of every unit it was inside: their calls go to DONE and drop their tensors, and the next
pass starts from sharded units. A pre-forward hook that raises (an order mismatch) opens
nothing, so its post-forward hook finds the unit closed and does nothing. A backward that
raises never runs the callback that ends it; the next forward that starts outside autograd's
engine finds the backward still open and closes it (`_abandon_backward`): it waits for the
Reduce-Scatters in flight without adding them and frees what was re-gathered; `.grad` holds
what the finished units added, as a single process keeps what its finished nodes accumulated:
zero it. Whether autograd's engine is running comes from `torch._C._current_graph_task_id()`
(private; torch's own checkpoint and FSDP2 use it; tried on torch 2.13). Where it is missing,
the engine trusts its flag as before, and a backward that raised stays open.

[Note: inference mode]
A tensor allocated under `torch.inference_mode()` can never be updated in place outside it, so
a pooled buffer first allocated there would break every later training step. The engine's own
work (gathers, releases, pool allocations) runs with inference mode switched off and gradients
off; the module's compute on the full tensors stays under the caller's mode.

[Note: root parameters outside the root's forward]
The root unit is gathered around the root module's forward. The modules that own its
parameters also carry the unit's forward hooks: inside the root's forward they only nest (and
re-gather if an optimizer step made the tensors stale, e.g. manual optimization), and called
directly (`model.net(x)`, `model.generate(...)`) they gather the root unit for their own
forward, with a backward of its own like any unit call. A root without parameters of its
own (`nn.Sequential` of blocks) is hooked too: it gathers nothing, but its forward frames the
pass, so the units inside run in one recorded order and prefetch; unhooked, each top-level unit
began a pass of its own and announced a departure from the one-unit record.

[Note: recomputation]
Activation checkpointing runs a unit's forward again inside backward. Non-reentrant: the
unit's output hook has already re-gathered it (state BACKWARD), so the recomputed forward reuses
the shadowed full tensors and frees nothing. Reentrant: the first forward ran under no_grad (no
backward state), so the recomputation is an ordinary forward with its own `GatherParams`, and
the inner backward that follows reduces it.

[Note: torch.compile]
The hooks gather, release and reduce: collectives, storage moves, data pointers and per-call
Python state (call states, depths, versions). Dynamo can put none of it in a graph, and the
values it would guard on change every call: traced, the hooks cut a compiled GPT into 39 graphs
with 23 graph breaks and recompiled `start_gather` up to the recompile limit (issue 15). Every
entry point the engine gives torch (forward pre/post hooks, the hooks on outputs and inputs,
`post_backward`, the callbacks of backward) is wrapped in `torch.compiler.disable` (`_eager`):
dynamo ends the graph at the hook, runs the hook eagerly and resumes after it, and the compiled
code reads the full tensors the hook put on the modules as ordinary graph inputs. A block
compiled by itself (`block.compile()`, as FSDP2 advises) runs its hooks before and after its
graph, and blocks of one class share that graph. A model compiled whole is cut at every hooked
module: each unit's module and the modules that own root parameters. Measured in
docs/performance.md, "torch.compile"; tested in tests/test_engine_compile.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten  # private: Note below the imports

from lightning_zero3.engine.buffers import return_free_host_memory
from lightning_zero3.engine.calls import (
    HOLDING,
    LEGAL,
    CallState,
    GatherParams,
    Slot,
    UnitCall,
    autograd_running,
    engine_mode,
)
from lightning_zero3.engine.calls import CallState as S
from lightning_zero3.engine.comm import CollectiveError
from lightning_zero3.engine.held import UNSYNCED_HINT, HeldUnits
from lightning_zero3.engine.reductions import Reductions
from lightning_zero3.engine.unit import OrderMismatchError, Unit

# `torch.utils._pytree` is private (torch 2.13 has no public pytree module): it is what FSDP2
# flattens hook arguments with and where transformers registers its ModelOutput classes, so
# their tensors are found. Tried: torch 2.13.0. No fallback: a move fails at import, not silently.

if TYPE_CHECKING:
    from lightning_zero3.engine.model import ShardedModel

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _eager(hook: _Hook) -> _Hook:
    """`hook` runs eagerly, never traced by dynamo (Note: torch.compile)."""
    return torch.compiler.disable(hook, recursive=True, reason="ZeRO-3 hooks run eagerly: collectives, storage moves")


DEEPCOPY_REFUSED = (
    "A module sharded by lightning_zero3 cannot be deep-copied: its parameters are this rank's 1-D "
    "shards and its hooks belong to the sharding engine. Make the copy before setup (in __init__ or "
    "configure_model: it is then sharded with the module), or build a new module and load the "
    "whole weights into it (ShardedModel.full_state_dict, or a checkpoint)."
)


class HookDriver:
    """Installs the hooks on a `ShardedModel`'s unit modules and runs the unit life cycle."""

    def __deepcopy__(self, memo: dict) -> HookDriver:
        # Reached through the hooks when a sharded module is deep-copied (an EMA teacher made
        # after setup): without this, `copy` fails deep inside on the process group.
        raise TypeError(DEEPCOPY_REFUSED)

    def __init__(self, model: ShardedModel) -> None:
        self.model = model
        self.units = model.units
        self.schedule = model.schedule
        self._slots = [Slot() for _ in self.units]
        # Slots with an open forward hook (depth > 0), kept by `_set_depth`: 0 between passes.
        self._open = 0
        # Units whose gather this driver issued ahead (prefetch); some may have been used since.
        self._prefetched: list[Unit] = []
        # Calls of this pass that may still get a backward.
        self._pending: list[UnitCall] = []
        # Reduce-Scatters in flight (reductions.py, Note: asynchronous reduction).
        self._reductions = Reductions(model)
        self._in_backward = False
        # Units held gathered by `ShardedModel.gathered_for_inference()` (held.py).
        self.held = HeldUnits(self)
        self.handles: list[Any] = []
        root = self.units[0]
        for unit in self.units:
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
        # Units start the backward bookkeeping only through their pre-backward hooks. When none
        # runs (every trainable parameter is persistent, the sharded ones frozen), a persistent
        # parameter's gradient must start it, or `_end_backward` never all-reduces their grads.
        for param in model.persistent:
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._on_persistent_grad))

    def remove(self) -> None:
        """Remove the hooks. Calls still holding full parameters are closed first: a kept call
        whose backward never came (a fit that failed in between) gives its memory back, and
        the calls a backward that raised left on the modules (Note: exceptions) would shadow the
        registered parameters for good. No collective: the Reduce-Scatters of such a backward
        are dropped unwaited (leave_sharded may follow a failure where other ranks are gone)."""
        self._drop_leftovers()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ---- the one place where a call changes state (calls.py, Note: call states) -----------
    def _move(self, call: UnitCall, state: CallState) -> None:
        old = call.state
        assert (old, state) in LEGAL, f"ZeRO-3 internal error: unit '{call.unit.name}' {old.name} -> {state.name}"
        slot = self._slots[call.unit.uid]
        if state is S.KEPT:
            assert slot.kept is None, f"ZeRO-3 internal error: unit '{call.unit.name}' kept twice"
            slot.kept = call
        elif old is S.KEPT and slot.kept is call:
            slot.kept = None
        if state in (S.RESHARDED, S.DONE, S.KEPT) and slot.call is call:
            slot.call = None
            for sharded in call.unit.params:
                for module, attr in sharded.owners:
                    module.__dict__.pop(attr, None)
        elif state in (S.FORWARD, S.BACKWARD) and slot.call is None:
            for sharded, full in zip(call.unit.params, call.fulls):
                for module, attr in sharded.owners:
                    module.__dict__[attr] = full
            slot.call = call
        if state is S.RESHARDED or (state is S.DONE and old in (S.BACKWARD, S.KEPT)):
            with engine_mode():  # autograd keeps the tensor objects; the memory goes to the pool
                call.unit.release(call.fulls)
        elif state is S.DONE and old is S.FORWARD and not call.reduces:
            # No backward is owed (evaluation, a held call, outputs without grad): the block goes
            # back to the pool, so an evaluation step allocates no full parameters.
            with engine_mode():
                call.unit.release(call.fulls)
            call.fulls = []
        elif state is S.DONE and old in (S.FORWARD, S.REDUCED_IN_FORWARD):
            call.fulls = []  # autograd may still hold them (GatherParams' outputs): they die with it
        call.state = state
        if (old in HOLDING) != (state in HOLDING):
            self.model.on_alive_change(call.unit, +1 if state in HOLDING else -1)

    def _versions(self, unit: Unit) -> tuple[int, ...]:
        return tuple(p.param._version for p in unit.params)

    # ---- forward ----------------------------------------------------------------------------
    def _gather_call(self, unit: Unit) -> UnitCall:
        """Gather the unit into a new call (state FORWARD, on the unit's modules)."""
        reduces = torch.is_grad_enabled() and any(p.requires_grad for p in unit.params)
        call = UnitCall(unit, reduces=reduces)
        with torch.profiler.record_function(f"ZeRO3::gather({unit.name})"):
            if reduces:
                call.fulls = list(GatherParams.apply(self, call, *(p.param for p in unit.params)))
            else:
                with engine_mode():
                    call.fulls = unit.gather()
        call.versions = self._versions(unit)
        self._move(call, S.FORWARD)
        return call

    @_eager
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        slot = self._slots[unit.uid]
        if self.held.active:
            self.held.pre_forward(unit, slot)
            return None
        current = slot.call
        if self._in_backward and current is not None and current.state is S.BACKWARD:
            # Non-reentrant recomputation: reuse the re-gathered parameters. Its forward may be
            # cut short (checkpoint stops once it has what backward needs), so no post-forward
            # hook is owed: the depth stays 0 and the post-forward hook does nothing.
            return None
        if slot.depth:
            self._set_depth(slot, slot.depth + 1)  # re-entered (self(x) inside training_step): already whole
            if current is not None and (
                current.state is S.REDUCED_IN_FORWARD or current.versions != self._versions(unit)
            ):
                # Stale (an optimizer step inside training_step): its own backward, if still
                # owed, keeps its tensors through autograd.
                self._move(current, S.DONE)
                self._gather_call(unit)
            return None
        if self._in_backward and not autograd_running():
            self._abandon_backward()
        if not self._in_backward and not self._open:
            self._begin_pass()
        call = None  # a root without parameters gathers nothing: it opens the pass and prefetches
        try:
            if unit.params:
                if not self._in_backward:
                    self.model.before_gather(unit, backward=False)  # tags.py: departure notice
                call = self._gather_call(unit)
        except (CollectiveError, OrderMismatchError) as err:
            if torch.is_grad_enabled() or self._in_backward:
                raise
            raise type(err)(f"{err} {UNSYNCED_HINT}") from err  # held.py, Note: held for inference
        self._set_depth(slot, 1)  # last: a pre-forward that raised opens nothing (Note: exceptions)
        if not self._in_backward:  # evaluation passes prefetch too
            self._prefetch_ahead(unit, backward=False)
        if call is not None and not call.reduces and torch.is_grad_enabled():
            self._hook_inputs(call, args, kwargs)
        return None

    def _set_depth(self, slot: Slot, depth: int) -> None:
        """The one place a slot's count of open forward hooks changes, so `_open` stays exact."""
        self._open += (depth > 0) - (slot.depth > 0)
        slot.depth = depth

    def _hook_inputs(self, call: UnitCall, args: Any, kwargs: Any) -> None:
        """Release a frozen unit's call once its inputs have their gradients (Note: frozen
        units). The hook holds the call weakly (calls.py, Note: call lifetime)."""
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, partial(self._after_input_grads, weakref.ref(call)), mode="all")

    @_eager
    def _after_input_grads(self, call_ref: weakref.ref[UnitCall], grads: Any) -> None:
        call = call_ref()
        if call is not None:
            self.finish_call(call)

    @_eager
    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        slot = self._slots[unit.uid]
        if self.held.active:
            self.held.post_forward(slot)
            return
        if not slot.depth:
            return  # end of a recomputation (see _pre_forward), or a pre-forward that raised
        self._set_depth(slot, slot.depth - 1)
        if slot.depth:
            return
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not self._in_backward and not self._open:
            # The pass's forward is over (or raised): a prefetch it did not use is stale, and
            # with no output that needs a gradient, so is what it kept (Note: kept for backward).
            self._release_stale_prefetches()
            if not outputs:
                self._release_kept()
        if slot.call is None:
            return
        call = slot.call
        if call.state is not S.FORWARD or not outputs:
            # Reduced inside its forward, no_grad, nothing of it needs a gradient, or the
            # forward raised (output None): no backward owed.
            self._move(call, S.DONE)
            return
        self._move(call, S.KEPT if self._ends_forward(unit) else S.RESHARDED)
        self._pending.append(call)
        for tensor in outputs:
            tensor.register_hook(partial(self._pre_backward, call))

    def _ends_forward(self, unit: Unit) -> bool:
        """Whether backward begins with this unit's call, so it is kept (Note: kept for backward):
        a root call that closes the pass (not one inside another unit's forward), or any call
        that ends once the forward has run the whole record."""
        if self._in_backward:
            return False
        return (unit is self.units[0] and not self._open) or self.schedule.forward_complete

    def is_kept(self, unit: Unit) -> bool:
        """Whether a call of `unit` is kept gathered for a backward that has not reached it."""
        return self._slots[unit.uid].kept is not None

    def _drop_leftovers(self) -> None:
        """Between passes (a new one begins, or the hooks go), in one walk over the units: a
        kept call gives its memory back (its backward, if it still comes, gathers again), and a
        call still on its modules, left by a pass that raised (Note: exceptions), is closed."""
        for slot in self._slots:
            if slot.kept is not None:
                self._move(slot.kept, S.RESHARDED)
            if slot.call is not None:
                self._move(slot.call, S.DONE)

    def _release_kept(self) -> None:
        """Kept calls whose backward has not begun give their memory back; it gathers again."""
        for slot in self._slots:
            if slot.kept is not None:
                self._move(slot.kept, S.RESHARDED)

    def _prefetch_ahead(self, unit: Unit, *, backward: bool) -> None:
        """`unit` starts: gather the units the record says come next; if it just left the
        record, drop the prefetches issued from it."""
        schedule = self.schedule
        on_track = schedule.backward_on_track if backward else schedule.forward_on_track
        for ahead in (schedule.on_backward if backward else schedule.on_forward)(unit.uid):
            self._prefetch(self.units[ahead])
        if on_track and not (schedule.backward_on_track if backward else schedule.forward_on_track):
            self._release_stale_prefetches()

    def _prefetch(self, unit: Unit) -> None:
        slot = self._slots[unit.uid]
        if not unit.params or unit.gather_in_flight or slot.call is not None or slot.kept is not None:
            return
        with engine_mode():
            unit.start_gather()
        self._prefetched.append(unit)
        self.model.on_alive_change(unit, 0)

    def _release_stale_prefetches(self) -> None:
        """The pass just departed from the recorded order: drop the prefetches issued from the
        record. A rank that departs alone must not keep one and skip re-issuing it later (its
        collectives would then pair with different kinds of collectives on the other ranks and
        hang until the timeout); without it, the first unit that differs meets the unit tag
        check (Note: flat layout and unit tag) and fails with both units named."""
        prefetched, self._prefetched = self._prefetched, []
        for unit in prefetched:
            if unit.gather_in_flight:  # not used by the unit's gather since
                with engine_mode():
                    unit.discard_gather()
            self.model.on_alive_change(unit, 0)

    def _begin_pass(self) -> None:
        self.model.begin_pass_checks()  # tags left by a pass without backward (tags.py)
        # Prefetches left from the previous pass may predate an optimizer step: drop them. No
        # forward hook is open, so a call still on its modules is a leftover of a pass that
        # raised (Note: exceptions).
        self._release_stale_prefetches()
        self._drop_leftovers()
        self._pending = []
        self.schedule.begin_forward()

    # ---- backward ---------------------------------------------------------------------------
    def _ensure_backward_started(self) -> None:
        self.held.refuse_backward()
        if self._in_backward:
            return
        self._in_backward = True
        self.schedule.begin_backward()
        Variable._execution_engine.queue_callback(self._end_backward)

    @_eager
    def _on_persistent_grad(self, param: torch.Tensor) -> None:
        self._ensure_backward_started()

    @_eager
    def _pre_backward(self, call: UnitCall, grad: torch.Tensor) -> None:
        if call.state not in (S.RESHARDED, S.KEPT, S.DONE) or not call.fulls:
            return  # gathered already, or a call that owes no backward
        self._ensure_backward_started()
        unit = call.unit
        with torch.profiler.record_function(f"ZeRO3::pre_backward({unit.name})"):
            if call.state is not S.KEPT:  # a kept call is whole already (Note: kept for backward)
                if call.state is S.DONE:
                    self._pending.append(call)  # a second backward through a retained graph
                self.model.before_gather(unit, backward=True)  # tags.py: departure notice
                with engine_mode():
                    unit.gather(into=call.fulls)
            self._move(call, S.BACKWARD)
            self._prefetch_ahead(unit, backward=True)

    @_eager
    def post_backward(self, call: UnitCall, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Called by `GatherParams.backward` once autograd has every full gradient of the call.
        Starts the Reduce-Scatter and returns no gradient to autograd (reductions.py, Note:
        asynchronous reduction)."""
        self._ensure_backward_started()
        unit = call.unit
        self._reductions.start(unit, grads)
        if call.state is S.FORWARD:
            self._move(call, S.REDUCED_IN_FORWARD)  # tensors stay on the modules until forward ends
        else:
            self.finish_call(call)
        return [None] * len(unit.params)

    def finish_call(self, call: UnitCall) -> None:
        """The call's backward is over: release what its pre-backward gathered. Nothing to do
        for a call whose tensors were never gathered again (its outputs got no gradient)."""
        if call.state is S.BACKWARD:
            self._move(call, S.DONE)

    def _abandon_backward(self) -> None:
        """Close a backward that raised (Note: exceptions)."""
        self._reductions.drop_all()
        for slot in self._slots:
            if slot.call is not None and slot.call.state is S.BACKWARD:
                self._move(slot.call, S.DONE)
        self._close_pending()
        self._in_backward = False

    @_eager
    def _end_backward(self) -> None:
        self._reductions.finish_all()
        self.model.check_tags()  # the step's one host sync, before the optimizer step (tags.py)
        self._close_pending()
        self.model.reduce_persistent_grads()
        if self.model.host_memory_slack is not None:
            return_free_host_memory(self.model.host_memory_slack)
        self.schedule.end_backward()
        self._in_backward = False
        self.model.on_backward_end()

    def _close_pending(self) -> None:
        """End of a backward: free what a pre-backward re-gathered for calls whose backward did
        not finish them (outputs that never reached the loss, frozen calls whose inputs needed no
        gradient, a backward that raised), and drop unused prefetches."""
        for call in self._pending:
            if call.state in (S.BACKWARD, S.RESHARDED, S.KEPT):
                self._move(call, S.DONE)
        self._pending = []
        self._release_stale_prefetches()
