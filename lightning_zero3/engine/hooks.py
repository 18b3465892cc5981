"""Forward and backward hooks that drive units. All autograd plumbing lives in this file.

[Note: one unit call]
Each time a unit's module runs forward, its shards are gathered into full tensors (one
All-Gather); with a trainable parameter and gradients enabled, `_GatherParams` does it and
becomes their autograd parent. The full tensors are set on the modules as instance attributes
that shadow the registered shard parameters (`module.__dict__[name]`), so the module's own
forward code reads them unchanged, and removed after forward; their storage is freed but the
tensor objects survive inside autograd's saved tensors. A hook on the unit's outputs fires when
their gradient arrives, before the unit's own backward runs, and gathers again into the same
storage. When autograd has every full parameter's gradient it calls `_GatherParams.backward`,
which Reduce-Scatters them; each rank's averaged shard gradient is added into `shard.grad`
(Note: asynchronous reduction). One call, one reduction, added up: that is what makes
accumulation, tied weights and modules called twice exact without special cases.

[Note: frozen units]
A unit without a trainable parameter still runs backward whenever its input needs a gradient
(LoRA, partial fine-tuning), and autograd saves its full weights for that. It is released after
forward and re-gathered by the output hook like any other unit, but no `_GatherParams.backward`
tells when its backward is over, so its tensor inputs that need a gradient pass through
`_AfterBackward`, an identity whose backward runs once autograd has the unit's input gradients,
i.e. after every node of the unit that reads the weights; it releases them. No Reduce-Scatter.

[Note: call states]
Every `UnitCall` is in one `CallState` and changes state only in `HookDriver._move`, which
asserts that the transition is legal and does what the move means (free the storage, count the
unit alive or not, take the tensors off the modules):

    FORWARD --post-forward--> RESHARDED --pre-backward--> BACKWARD --post-backward--> DONE
    FORWARD --post-forward, no backward owed (no_grad, outputs without grad)--------> DONE
    FORWARD --backward inside the unit's own forward (manual optimization)--> REDUCED_IN_FORWARD
    REDUCED_IN_FORWARD --post-forward--> DONE;   RESHARDED --backward never reached it--> DONE
    DONE --pre-backward of a second backward (retain_graph)--> BACKWARD

Per unit the driver keeps a `_Slot`: the call whose tensors are on the modules and how many
forward hooks of the unit are open (a unit called inside itself, or the owner modules of root
parameters inside the root's forward, gather once). A pass begins when a unit starts forward
while no unit is open and no backward runs; `_begin_pass` drops what an earlier pass left.
Post-forward hooks are registered with `always_call=True`, so a forward that raises closes its
unit like one that returns (Note: exceptions).

[Note: exceptions]
A forward that raises (out of memory in a block, caught by a `try`) still runs the post-forward
hooks of every unit it was inside: their calls go to DONE and free their tensors, and the next
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
forward, with a backward of its own like any unit call.

[Note: asynchronous reduction]
`_GatherParams.backward` only starts a unit's Reduce-Scatter and returns no gradient to autograd;
the backward of the next unit computes while it is in flight. The reduced shard gradients are
added into `shard.grad` by the engine when the reduction is waited for: once more than
`ShardedModel(reductions_in_flight=k)` are pending (default 0: at once), and for all of them in
the callback that ends backward, so `.grad` is complete when `backward()` returns. With k > 0
a rank that runs different units than the others (data-dependent control flow) may meet a
collective of another size before a tag check, which gloo answers by aborting that process;
the other ranks still raise the error naming the unit. Adding (rather than assigning) keeps
accumulation, tied weights and modules called twice exact.

[Note: call lifetime]
A `UnitCall` is held by the driver while its pass may still need it (`_Slot.call`, `_pending`)
and by the hooks on the unit's outputs for as long as autograd's graph lives (so backward, and
a second backward with retain_graph, find it). The autograd Functions only keep a weak
reference: the call owns the full tensors, whose grad_fn owns the ctx, and a strong reference
from ctx to the call would close a cycle through C++ that Python's garbage collector cannot
break.

[Note: recomputation]
Activation checkpointing runs a unit's forward again inside backward. Non-reentrant: the
unit's output hook has already re-gathered it (state BACKWARD), so the recomputed forward reuses
the shadowed full tensors and frees nothing. Reentrant: the first forward ran under no_grad (no
backward state), so the recomputation is an ordinary forward with its own `_GatherParams`, and
the inner backward that follows reduces it.
"""

from __future__ import annotations

import weakref
from collections import deque
from contextlib import AbstractContextManager, ExitStack, nullcontext
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_zero3.engine.buffers import return_free_host_memory
from lightning_zero3.engine.unit import PendingReduce, Unit

if TYPE_CHECKING:
    from lightning_zero3.engine.model import ShardedModel


class CallState(Enum):
    SHARDED = "sharded"  # created, not gathered yet
    FORWARD = "unsharded for forward"  # full parameters gathered and on the modules
    RESHARDED = "resharded, awaiting backward"  # storage freed, autograd keeps the tensor objects
    BACKWARD = "unsharded for backward"  # gathered again for the unit's backward
    REDUCED_IN_FORWARD = "reduced inside its forward"  # manual optimization: still on the modules
    DONE = "done"  # nothing held, no backward owed


S = CallState
_LEGAL = {
    (S.SHARDED, S.FORWARD), (S.FORWARD, S.RESHARDED), (S.FORWARD, S.DONE),
    (S.FORWARD, S.REDUCED_IN_FORWARD), (S.REDUCED_IN_FORWARD, S.DONE), (S.RESHARDED, S.BACKWARD),
    (S.RESHARDED, S.DONE), (S.BACKWARD, S.DONE), (S.DONE, S.BACKWARD),
}  # fmt: skip
_HOLDING = (S.FORWARD, S.BACKWARD, S.REDUCED_IN_FORWARD)  # states whose storage is filled


class UnitCall:
    """One forward execution of a unit and the full tensors it produced."""

    def __init__(self, unit: Unit, *, reduces: bool) -> None:
        self.unit = unit
        self.reduces = reduces  # produced by _GatherParams: its backward Reduce-Scatters
        self.fulls: list[torch.Tensor] = []
        self.state = CallState.SHARDED
        # Shard versions when gathered: an optimizer step in between makes the fulls stale.
        self.versions: tuple[int, ...] = ()


def _engine_mode() -> AbstractContextManager[None]:
    """Inference mode off, gradients off, for the engine's own tensors (Note: inference mode)."""
    if not torch.is_inference_mode_enabled():
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())  # leaving inference mode would enable gradients
    return stack


class _GatherParams(torch.autograd.Function):
    """shards -> full parameters (All-Gather); backward: full grads -> shard grads (Reduce-Scatter)."""

    @staticmethod
    def forward(ctx: Any, driver: HookDriver, call: UnitCall, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # A strong reference to the call would be a cycle through C++ (Note: call lifetime).
        ctx.driver, ctx.call = driver, weakref.ref(call)
        ctx.set_materialize_grads(False)
        fulls = call.unit.gather()
        frozen = [full for full, shard in zip(fulls, shards) if not shard.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(fulls)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call = ctx.call()
        if call is None:
            raise RuntimeError(
                "ZeRO-3 backward reached the parameters of a unit whose forward belongs to an earlier "
                "pass: every forward pass releases the previous pass's gathered parameters. Run "
                "backward before the next forward of the model."
            )
        shard_grads = ctx.driver.post_backward(call, list(grads))
        return (None, None, *shard_grads)


class _AfterBackward(torch.autograd.Function):
    """Identity on a frozen unit's inputs; its backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx: Any, driver: HookDriver, call: UnitCall, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.driver, ctx.call = driver, weakref.ref(call)
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call = ctx.call()
        if call is not None and call.state is CallState.BACKWARD:
            ctx.driver.finish_call(call)
        return (None, None, *grads)


def _autograd_running() -> bool:
    """Whether autograd's engine is executing a backward on this thread (Note: exceptions)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is None or task_id() != -1


class _Slot:
    """Per unit: the call whose full tensors are on the modules, and the open forward hooks."""

    __slots__ = ("call", "depth")

    def __init__(self) -> None:
        self.call: UnitCall | None = None
        self.depth = 0


class HookDriver:
    """Installs the hooks on a `ShardedModel`'s unit modules and runs the unit life cycle."""

    def __init__(self, model: ShardedModel) -> None:
        self.model = model
        self.units = model.units
        self.schedule = model.schedule
        self._slots = [_Slot() for _ in self.units]
        # Calls of this pass that may still get a backward.
        self._pending: list[UnitCall] = []
        # Reduce-Scatters in flight, oldest first (Note: asynchronous reduction).
        self._reductions: deque[tuple[Unit, PendingReduce]] = deque()
        self._in_backward = False
        self.handles: list[Any] = []
        root = self.units[0]
        for unit in self.units:
            if not unit.params:
                continue
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
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ---- the one place where a call changes state (Note: call states) ----------------------
    def _move(self, call: UnitCall, state: CallState) -> None:
        old = call.state
        assert (old, state) in _LEGAL, f"ZeRO-3 internal error: unit '{call.unit.name}' {old.name} -> {state.name}"
        slot = self._slots[call.unit.uid]
        if state in (S.RESHARDED, S.DONE) and slot.call is call:
            slot.call = None
            for sharded in call.unit.params:
                for module, attr in sharded.owners:
                    module.__dict__.pop(attr, None)
        elif state in (S.FORWARD, S.BACKWARD) and slot.call is None:
            for sharded, full in zip(call.unit.params, call.fulls):
                for module, attr in sharded.owners:
                    module.__dict__[attr] = full
            slot.call = call
        if state is S.RESHARDED or (state is S.DONE and old is S.BACKWARD):
            with _engine_mode():  # autograd keeps the tensor objects; the memory goes to the pool
                call.unit.release(call.fulls)
        elif state is S.DONE and old in (S.FORWARD, S.REDUCED_IN_FORWARD):
            call.fulls = []  # no backward of ours needs them; they die with their last reference
        call.state = state
        if (old in _HOLDING) != (state in _HOLDING):
            self.model.on_alive_change(call.unit, +1 if state in _HOLDING else -1)

    def _versions(self, unit: Unit) -> tuple[int, ...]:
        return tuple(p.param._version for p in unit.params)

    # ---- forward ----------------------------------------------------------------------------
    def _gather_call(self, unit: Unit) -> UnitCall:
        """Gather the unit into a new call (state FORWARD, on the unit's modules)."""
        reduces = torch.is_grad_enabled() and any(p.requires_grad for p in unit.params)
        call = UnitCall(unit, reduces=reduces)
        with torch.profiler.record_function(f"ZeRO3::gather({unit.name})"):
            if reduces:
                call.fulls = list(_GatherParams.apply(self, call, *(p.param for p in unit.params)))
            else:
                with _engine_mode():
                    call.fulls = unit.gather()
        call.versions = self._versions(unit)
        self._move(call, S.FORWARD)
        return call

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Any:
        slot = self._slots[unit.uid]
        current = slot.call
        if self._in_backward and current is not None and current.state is S.BACKWARD:
            # Non-reentrant recomputation: reuse the re-gathered parameters. Its forward may be
            # cut short (checkpoint stops once it has what backward needs), so no post-forward
            # hook is owed: the depth stays 0 and the post-forward hook does nothing.
            return None
        if slot.depth:
            slot.depth += 1  # re-entered (e.g. self(x) inside training_step): already whole
            if current is not None and (
                current.state is S.REDUCED_IN_FORWARD or current.versions != self._versions(unit)
            ):
                # Stale (an optimizer step inside training_step): its own backward, if still
                # owed, keeps its tensors through autograd.
                self._move(current, S.DONE)
                self._gather_call(unit)
            return None
        if self._in_backward and not _autograd_running():
            self._abandon_backward()
        if not self._in_backward and not any(s.depth for s in self._slots):
            self._begin_pass()
        call = self._gather_call(unit)
        slot.depth = 1  # last: a pre-forward that raised opens nothing (Note: exceptions)
        if torch.is_grad_enabled() and not self._in_backward:
            on_track = self.schedule.forward_on_track
            for ahead in self.schedule.on_forward(unit.uid):
                self._prefetch(self.units[ahead])
            if on_track and not self.schedule.forward_on_track:
                self._release_stale_prefetches()
        if not call.reduces and torch.is_grad_enabled():
            return self._mark_inputs(call, args, kwargs)
        return None

    def _mark_inputs(self, call: UnitCall, args: Any, kwargs: Any) -> Any:
        """Route a frozen unit's inputs that need a gradient through `_AfterBackward` (Note:
        frozen units)."""
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not where:
            return None
        marked = _AfterBackward.apply(self, call, *(leaves[i] for i in where))
        for i, tensor in zip(where, marked):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        slot = self._slots[unit.uid]
        if not slot.depth:
            return  # end of a recomputation (see _pre_forward), or a pre-forward that raised
        slot.depth -= 1
        if slot.depth:
            return
        if not self._in_backward and not any(s.depth for s in self._slots):
            # The pass's forward is over (or raised): a prefetch it did not use is stale.
            self._release_stale_prefetches()
        if slot.call is None:
            return
        call = slot.call
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if call.state is not S.FORWARD or not outputs:
            # Reduced inside its forward, no_grad, nothing of it needs a gradient, or the
            # forward raised (output None): no backward owed.
            self._move(call, S.DONE)
            return
        self._move(call, S.RESHARDED)
        self._pending.append(call)
        for tensor in outputs:
            tensor.register_hook(partial(self._pre_backward, call))

    def _prefetch(self, unit: Unit) -> None:
        if not unit.params or unit.gather_in_flight or self._slots[unit.uid].call is not None:
            return
        with _engine_mode():
            unit.start_gather()
        self.model.on_alive_change(unit, 0)

    def _release_stale_prefetches(self) -> None:
        """The pass just departed from the recorded order: drop the prefetches issued from the
        record. A rank that departs alone must not keep one and skip re-issuing it later (its
        collectives would then pair with different kinds of collectives on the other ranks and
        hang until the timeout); without it, the first unit that differs meets the unit tag
        check (Note: flat layout and unit tag) and fails with both units named."""
        for unit in self.units:
            if unit.gather_in_flight:
                with _engine_mode():
                    unit.discard_gather()
        self.model.on_alive_change(None, 0)

    def _begin_pass(self) -> None:
        # Prefetches left from the previous pass may predate an optimizer step: drop them. No
        # forward hook is open, so a call still on its modules is a leftover of a pass that
        # raised (Note: exceptions).
        self._release_stale_prefetches()
        for slot in self._slots:
            if slot.call is not None:
                self._move(slot.call, S.DONE)
        self._pending = []
        self.schedule.begin_forward()

    # ---- backward ---------------------------------------------------------------------------
    def _ensure_backward_started(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self.schedule.begin_backward()
        Variable._execution_engine.queue_callback(self._end_backward)

    def _on_persistent_grad(self, param: torch.Tensor) -> None:
        self._ensure_backward_started()

    def _pre_backward(self, call: UnitCall, grad: torch.Tensor) -> None:
        if call.state not in (S.RESHARDED, S.DONE) or not call.fulls:
            return  # gathered already, or a call that owes no backward
        self._ensure_backward_started()
        unit = call.unit
        with torch.profiler.record_function(f"ZeRO3::pre_backward({unit.name})"):
            if call.state is S.DONE:
                self._pending.append(call)  # a second backward through a retained graph
            with _engine_mode():
                unit.gather(into=call.fulls)
            self._move(call, S.BACKWARD)
            on_track = self.schedule.backward_on_track
            for ahead in self.schedule.on_backward(unit.uid):
                self._prefetch(self.units[ahead])
            if on_track and not self.schedule.backward_on_track:
                self._release_stale_prefetches()

    def post_backward(self, call: UnitCall, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Called by `_GatherParams.backward` once autograd has every full gradient of the call.
        Starts the Reduce-Scatter and returns no gradient to autograd (Note: asynchronous
        reduction)."""
        self._ensure_backward_started()
        unit = call.unit
        with torch.profiler.record_function(f"ZeRO3::reduce_grads({unit.name})"):
            grads = [g if p.requires_grad else None for g, p in zip(grads, unit.params)]
            self._reductions.append((unit, unit.start_reduce(grads)))
            while len(self._reductions) > self.model.reductions_in_flight:
                self._finish_reduction()
        if call.state is S.FORWARD:
            self._move(call, S.REDUCED_IN_FORWARD)  # tensors stay on the modules until forward ends
        else:
            self.finish_call(call)
        return [None] * len(unit.params)

    def finish_call(self, call: UnitCall) -> None:
        """The call's backward is over: release what its pre-backward gathered."""
        if call.state is S.BACKWARD:
            self._move(call, S.DONE)

    def _finish_reduction(self) -> None:
        """Wait for the oldest Reduce-Scatter and add its shard gradients into `.grad`."""
        unit, pending = self._reductions.popleft()
        with torch.profiler.record_function(f"ZeRO3::wait_reduce({unit.name})"):
            shard_grads = unit.finish_reduce(pending)
        for sharded, grad in zip(unit.params, shard_grads):
            if grad is None:
                continue
            if sharded.param.grad is None:
                sharded.param.grad = grad  # a view of the unit's reduced buffer: no copy
            else:
                sharded.param.grad.add_(grad)

    def _abandon_backward(self) -> None:
        """Close a backward that raised (Note: exceptions)."""
        while self._reductions:
            unit, pending = self._reductions.popleft()
            unit.finish_reduce(pending)  # the collective completes; its gradients are dropped
        for call in self._pending:
            if call.state in (S.BACKWARD, S.RESHARDED):
                self._move(call, S.DONE)
        for slot in self._slots:
            if slot.call is not None and slot.call.state is S.BACKWARD:
                self._move(slot.call, S.DONE)
        self._pending = []
        self._release_stale_prefetches()
        self._in_backward = False

    def _end_backward(self) -> None:
        while self._reductions:
            self._finish_reduction()
        # Calls whose outputs never reached the loss, and frozen calls whose inputs needed no
        # gradient: free what a pre-backward re-gathered.
        for call in self._pending:
            if call.state in (S.BACKWARD, S.RESHARDED):
                self._move(call, S.DONE)
        self._pending = []
        self._release_stale_prefetches()
        self.model.reduce_persistent_grads()
        if self.model.host_memory_slack is not None:
            return_free_host_memory(self.model.host_memory_slack)
        self.schedule.end_backward()
        self._in_backward = False
        self.model.on_backward_end()
