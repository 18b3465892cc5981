"""Forward and backward hooks that drive units. All autograd plumbing lives in this file.

[Note: one unit call]
Each time a unit's module runs forward with gradients enabled, `_GatherParams` turns the shards
into full tensors (one All-Gather) and becomes their autograd parent. The full tensors are set
on the modules as instance attributes that shadow the registered shard parameters
(`module.__dict__[name]`), so the module's own forward code reads them unchanged, and removed
after forward; their storage is freed but the tensor objects survive inside autograd's saved
tensors. A hook on the unit's outputs fires when their gradient arrives, before the unit's own
backward runs, and gathers again into the same storage. When autograd has every full
parameter's gradient it calls `_GatherParams.backward`, which Reduce-Scatters them; each rank's
averaged shard gradient is added into `shard.grad` (Note: asynchronous reduction). One call, one
reduction, added up: that is what makes accumulation, tied weights and modules called twice
exact without special cases.

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
A `UnitCall` is held by the driver while its pass may still need it (`_shadowing`, `_pending`)
and by the hooks on the unit's outputs for as long as autograd's graph lives (so backward, and
a second backward with retain_graph, find it). `_GatherParams` only keeps a weak reference:
the call owns the full tensors, whose grad_fn owns the ctx, and a strong reference from ctx to
the call would close a cycle through C++ that Python's garbage collector cannot break.

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
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from lightning_zero3.engine.buffers import return_free_host_memory
from lightning_zero3.engine.unit import PendingReduce, Unit

if TYPE_CHECKING:
    from lightning_zero3.engine.model import ShardedModel


class CallState(Enum):
    FORWARD = "forward"  # full parameters gathered and on the modules
    RESHARDED = "resharded"  # storage freed after forward, waiting for backward
    BACKWARD = "backward"  # gathered again for backward
    REDUCED = "reduced"  # gradients reduce-scattered; nothing held


class UnitCall:
    """One forward execution of a unit and the full tensors it produced."""

    def __init__(self, unit: Unit, *, differentiable: bool) -> None:
        self.unit = unit
        self.differentiable = differentiable  # produced by _GatherParams (has a backward)
        self.fulls: list[torch.Tensor] = []
        self.state = CallState.FORWARD
        # Shard versions when gathered: an optimizer step in between makes the fulls stale.
        self.versions: tuple[int, ...] = ()


class _GatherParams(torch.autograd.Function):
    """shards -> full parameters (All-Gather); backward: full grads -> shard grads (Reduce-Scatter)."""

    @staticmethod
    def forward(ctx: Any, driver: HookDriver, call: UnitCall, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The call holds the outputs (call.fulls) and their grad_fn holds ctx: a strong
        # reference back to the call would be a cycle through autograd's C++ graph, which
        # Python's garbage collector cannot see, leaking every call (Note: call lifetime).
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


class HookDriver:
    """Installs the hooks on a `ShardedModel`'s unit modules and runs the unit life cycle."""

    def __init__(self, model: ShardedModel) -> None:
        self.model = model
        self.units = model.units
        self.schedule = model.schedule
        # Nesting depth of each unit's forward (a unit called inside itself runs once).
        self._active: dict[int, int] = {}
        # The call whose full tensors are on the modules, per unit.
        self._shadowing: dict[int, UnitCall] = {}
        # Calls of this pass that may still get a backward.
        self._pending: list[UnitCall] = []
        # Reduce-Scatters in flight, oldest first (Note: asynchronous reduction).
        self._reductions: deque[tuple[Unit, PendingReduce]] = deque()
        self._depth = 0  # units currently inside forward
        self._in_backward = False
        self.handles: list[Any] = []
        for unit in self.units:
            if not unit.params:
                continue
            self.handles.append(unit.module.register_forward_pre_hook(partial(self._pre_forward, unit)))
            self.handles.append(unit.module.register_forward_hook(partial(self._post_forward, unit)))
        # The root unit stays active around the whole step (e.g. Lightning's training_step), so
        # a backward and an optimizer step can happen inside its forward (manual optimization).
        # Hooks on the modules that own its parameters re-gather it when it went stale.
        root = self.units[0]
        owners = {id(m): m for p in root.params for m, _ in p.owners if m is not root.module}
        for module in owners.values():
            self.handles.append(module.register_forward_pre_hook(partial(self._refresh_if_stale, root)))
        # Units start the backward bookkeeping only through a differentiable gather. When none
        # runs (every trainable parameter is persistent, the sharded ones frozen), a persistent
        # parameter's gradient must start it, or `_end_backward` never all-reduces their grads.
        for param in model.persistent:
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._on_persistent_grad))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # ---- shadowing the shard parameters with full tensors -----------------------------------
    def _shadow(self, call: UnitCall) -> None:
        for sharded, full in zip(call.unit.params, call.fulls):
            for module, attr in sharded.owners:
                module.__dict__[attr] = full
        self._shadowing[call.unit.uid] = call

    def _unshadow(self, call: UnitCall) -> None:
        if self._shadowing.get(call.unit.uid) is not call:
            return
        del self._shadowing[call.unit.uid]
        for sharded in call.unit.params:
            for module, attr in sharded.owners:
                module.__dict__.pop(attr, None)

    def _versions(self, unit: Unit) -> tuple[int, ...]:
        return tuple(p.param._version for p in unit.params)

    # ---- forward ----------------------------------------------------------------------------
    def _gather_call(self, unit: Unit) -> UnitCall:
        differentiable = torch.is_grad_enabled() and any(p.requires_grad for p in unit.params)
        call = UnitCall(unit, differentiable=differentiable)
        with torch.profiler.record_function(f"ZeRO3::gather({unit.name})"):
            if differentiable:
                call.fulls = list(_GatherParams.apply(self, call, *(p.param for p in unit.params)))
            else:
                call.fulls = unit.gather()
        call.versions = self._versions(unit)
        self.model.on_alive_change(unit, +1)
        return call

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        uid = unit.uid
        current = self._shadowing.get(uid)
        if self._in_backward and current is not None and current.state is CallState.BACKWARD:
            # Non-reentrant recomputation: reuse the re-gathered parameters. Its forward may be
            # cut short (checkpoint stops once it has what backward needs), so no post-forward
            # hook is owed: nothing is counted here.
            return
        if self._active.get(uid, 0):
            self._active[uid] += 1  # re-entered (e.g. self(x) inside training_step): already whole
            return
        self._active[uid] = 1
        if self._depth == 0 and not self._in_backward:
            self._begin_pass()
        self._depth += 1
        if not self._in_backward:  # [gpu] evaluation passes prefetch too
            self.model.before_gather(unit, backward=False)  # [gpu] tags.py: departure notice
        call = self._gather_call(unit)
        self._shadow(call)
        if not self._in_backward:  # [gpu] evaluation passes prefetch too
            on_track = self.schedule.forward_on_track
            for ahead in self.schedule.on_forward(uid):
                self._prefetch(self.units[ahead])
            if on_track and not self.schedule.forward_on_track:
                self._release_stale_prefetches()

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        uid = unit.uid
        if not self._active.get(uid, 0):
            return  # end of a recomputation (see _pre_forward): the backward owns these tensors
        self._active[uid] -= 1
        if self._active[uid]:
            return
        self._depth -= 1
        call = self._shadowing.get(uid)
        if call is None:
            return
        self._unshadow(call)
        if call.state is CallState.REDUCED:
            return  # its backward already ran inside this forward (manual optimization)
        if not call.differentiable:
            call.fulls = []  # no backward will need them from us (autograd keeps what it saved)
            self.model.on_alive_change(unit, -1)
            return
        call.unit.release(call.fulls)
        self.model.on_alive_change(unit, -1)
        call.state = CallState.RESHARDED
        self._pending.append(call)
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for tensor in outputs:
            tensor.register_hook(partial(self._pre_backward, call))

    def _refresh_if_stale(self, unit: Unit, module: nn.Module, args: Any) -> None:
        call = self._shadowing.get(unit.uid)
        if call is None or call.state is CallState.BACKWARD:
            return
        if call.state is CallState.REDUCED or call.versions != self._versions(unit):
            self._unshadow(call)
            if call.state is not CallState.REDUCED:
                self.model.on_alive_change(unit, -1)
            self._shadow(self._gather_call(unit))

    def _prefetch(self, unit: Unit) -> None:
        if not unit.params or unit.gather_in_flight or unit.uid in self._shadowing:
            return
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
                unit.discard_gather()
        self.model.on_alive_change(None, 0)

    def _begin_pass(self) -> None:
        self.model.begin_pass_checks()  # [gpu] tags left by a pass without backward
        # Prefetches left from the previous pass may predate an optimizer step: drop them.
        for unit in self.units:
            if unit.gather_in_flight:
                unit.discard_gather()
        self._pending = []
        self.schedule.begin_forward()
        self.model.on_alive_change(None, 0)

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
        if call.state not in (CallState.RESHARDED, CallState.REDUCED) or not call.fulls:
            return
        if call.state is CallState.REDUCED and call.fulls[0].untyped_storage().size() > 0:
            return
        self._ensure_backward_started()
        unit = call.unit
        with torch.profiler.record_function(f"ZeRO3::pre_backward({unit.name})"):
            self.model.before_gather(unit, backward=True)  # [gpu] tags.py: departure notice
            unit.gather(into=call.fulls)
            self.model.on_alive_change(unit, +1)
            call.state = CallState.BACKWARD
            if unit.uid not in self._shadowing:
                self._shadow(call)
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
        if call.state is CallState.BACKWARD:
            self._unshadow(call)
            call.unit.release(call.fulls)
            self.model.on_alive_change(unit, -1)
        elif call.state is CallState.FORWARD:
            # Backward inside the unit's own forward: keep the tensors on the modules until the
            # forward ends; `_refresh_if_stale` re-gathers if they are used again.
            pass
        call.state = CallState.REDUCED
        if call in self._pending:
            self._pending.remove(call)
        return [None] * len(unit.params)

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

    def _end_backward(self) -> None:
        while self._reductions:
            self._finish_reduction()
        self.model.check_tags()  # [gpu] the step's one host sync, before the optimizer step
        # Calls whose outputs never reached the loss: free what a pre-backward re-gathered.
        for call in self._pending:
            if call.state is CallState.BACKWARD:
                self._unshadow(call)
                call.unit.release(call.fulls)
                self.model.on_alive_change(call.unit, -1)
            call.state = CallState.REDUCED
        self._pending = []
        for unit in self.units:
            if unit.gather_in_flight:
                unit.discard_gather()
        self.model.reduce_persistent_grads()
        if self.model.host_memory_slack is not None:
            return_free_host_memory(self.model.host_memory_slack)
        self.schedule.end_backward()
        self._in_backward = False
        self.model.on_backward_end()
