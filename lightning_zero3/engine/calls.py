"""One unit call: its state, the autograd Function whose backward reduces it, and the pass state
(hooks.py, Note: one unit call).

[Note: call states]
A `UnitCall` changes state only in `CallTable.move`, which asserts the move is in `LEGAL` and
does what it means (frees the storage, counts the unit alive, takes the tensors off the modules):

    SHARDED --gather--> FORWARD --post-forward--> RESHARDED --pre-backward--> BACKWARD --post-backward--> DONE
    FORWARD --post-forward, no backward owed (no_grad, outputs without grad)----------------> DONE
    FORWARD --post-forward of a unit that ends the forward--> KEPT --pre-backward--> BACKWARD
    FORWARD --backward inside the unit's own forward (manual optimization)--> REDUCED_IN_FORWARD
    REDUCED_IN_FORWARD --post-forward--> DONE;   RESHARDED or KEPT --backward never reached it--> DONE
    KEPT --a new pass began, the forward ended without an output needing a gradient, hooks removed--> RESHARDED
    DONE --pre-backward of a second backward (retain_graph)--> BACKWARD

[Note: call lifetime]
The driver holds a call while its pass may need it (`Slot.call`, `_pending`), the hooks on its
outputs as long as autograd's graph lives (a second backward with retain_graph finds it);
`GatherParams` and the frozen-input hook hold it weakly: the call owns the whole tensors, whose
grad_fn owns the ctx, and a strong reference back would be a cycle through C++ that Python's GC
cannot break.

[Note: root parameters outside the root's forward]
The modules owning root parameters carry the root's forward hooks: inside the root's forward
they only nest; called directly (`model.net(x)`) they gather the root for a forward and backward
of their own. A root without parameters gathers nothing but frames the pass (one recorded order).

[Note: recomputation]
Activation checkpointing reruns a unit's forward inside backward. Non-reentrant: the output hook
has re-gathered the unit (BACKWARD) and the rerun reuses it. Reentrant: the first forward ran
under no_grad, so the rerun is an ordinary forward, reduced by the inner backward.

[Note: inference mode]
A tensor allocated under `torch.inference_mode()` can never be updated in place outside it, so a
pooled buffer first allocated there would break every later training step: the engine's own
work runs under `engine_mode()`, the module's compute under the caller's mode.

[Note: torch.compile]
The hooks' collectives, storage moves and Python state cannot be traced (traced, they cut a GPT
into 39 graphs and recompiled to the limit), so every entry point the engine gives torch is
`eager` (`torch.compiler.disable`): dynamo ends the graph at the hook and resumes after it. A
model compiled whole is cut at every hooked module; compile blocks instead, as FSDP2 advises
(docs/performance.md, "torch.compile").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import torch

from lightning_zero3.engine.record import StepRecord, UnitStats
from lightning_zero3.engine.unit import Unit

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def eager(hook: _Hook) -> _Hook:
    """Note: torch.compile."""
    return torch.compiler.disable(hook, recursive=True, reason="ZeRO-3 hooks run eagerly: collectives, storage moves")


# The driver's post-backward, which `GatherParams.backward` hands the whole gradients.
PostBackward = Callable[["UnitCall", list[torch.Tensor | None]], list[torch.Tensor | None]]


DEEPCOPY_REFUSED = (
    "A module sharded by lightning_zero3 cannot be deep-copied: its parameters are this rank's 1-D "
    "shards and its hooks belong to the sharding engine. Make the copy before sharding (it is then "
    "sharded with the module), or build a new module and load the whole weights into it "
    "(ShardedModel.full_state_dict, or a checkpoint)."
)
PICKLE_REFUSED = (
    "A module sharded by lightning_zero3 cannot be pickled (torch.save of it or of an object holding it): its "
    "parameters are this rank's 1-D shards and its hooks hold the engine's process groups. Save whole weights "
    "instead: ShardedModel.full_state_dict or a strategy's full_state_dict (collective), or a checkpoint."
)


class CallState(Enum):
    SHARDED = "sharded"  # created, not gathered yet
    FORWARD = "gathered for forward"  # whole parameters gathered and on the modules
    RESHARDED = "resharded, awaiting backward"  # storage freed, autograd keeps the tensor objects
    KEPT = "kept gathered for backward"  # ends the forward: not released, off the modules
    BACKWARD = "gathered for backward"  # gathered again (or kept) for the unit's backward
    REDUCED_IN_FORWARD = "reduced inside its forward"  # manual optimization: still on the modules
    DONE = "done"  # nothing gathered, no backward owed


S = CallState  # short name for the tables below
LEGAL = {
    (S.SHARDED, S.FORWARD),
    (S.FORWARD, S.RESHARDED),
    (S.FORWARD, S.DONE),
    (S.FORWARD, S.REDUCED_IN_FORWARD),
    (S.REDUCED_IN_FORWARD, S.DONE),
    (S.RESHARDED, S.BACKWARD),
    (S.RESHARDED, S.DONE),
    (S.BACKWARD, S.DONE),
    (S.DONE, S.BACKWARD),
    (S.FORWARD, S.KEPT),
    (S.KEPT, S.BACKWARD),
    (S.KEPT, S.RESHARDED),
    (S.KEPT, S.DONE),
}
HOLDING = (S.FORWARD, S.KEPT, S.BACKWARD, S.REDUCED_IN_FORWARD)  # states whose storage is filled


class PassState(Enum):
    """Changed only in `HookDriver._enter`, which asserts the move is in PASS_LEGAL. BACKWARD ends
    in FORWARD when forward hooks are still open (manual optimization); KEPT returns likewise."""

    IDLE = "idle"  # no forward hook open, no backward running
    FORWARD = "forward"  # some unit's forward hook is open
    BACKWARD = "backward"  # a backward runs through the units (recomputed forwards included)
    KEPT = "kept for inference"  # every unit gathered until gathered_for_inference() exits (kept.py)


P = PassState
PASS_LEGAL = {
    (P.IDLE, P.FORWARD),
    (P.FORWARD, P.IDLE),
    (P.IDLE, P.BACKWARD),
    (P.FORWARD, P.BACKWARD),
    (P.BACKWARD, P.IDLE),
    (P.BACKWARD, P.FORWARD),
    (P.IDLE, P.KEPT),
    (P.FORWARD, P.KEPT),
    (P.KEPT, P.IDLE),
    (P.KEPT, P.FORWARD),
}


@dataclass(eq=False)
class UnitCall:
    """One forward execution of a unit and the whole tensors it produced."""

    unit: Unit
    reduces: bool  # produced by GatherParams: its backward Reduce-Scatters
    wholes: list[torch.Tensor] = field(default_factory=list)
    state: CallState = CallState.SHARDED
    versions: tuple[int, ...] = ()


def engine_mode() -> AbstractContextManager[object]:
    """Note: inference mode."""
    if not torch.is_inference_mode_enabled():
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())  # leaving inference mode would enable gradients
    return stack


class GatherParams(torch.autograd.Function):
    """shards -> whole parameters (All-Gather); backward: whole grads -> shard grads (Reduce-Scatter)."""

    @staticmethod
    def forward(ctx: Any, post_backward: PostBackward, call: UnitCall, *shards: torch.Tensor) -> tuple[Any, ...]:
        # A strong reference to the call would be a cycle through C++ (Note: call lifetime).
        ctx.post_backward, ctx.call = post_backward, weakref.ref(call)
        ctx.set_materialize_grads(False)
        wholes = call.unit.gather()
        frozen = [whole for whole, shard in zip(wholes, shards) if not shard.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(wholes)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call = ctx.call()
        if call is None:
            raise RuntimeError(
                "ZeRO-3 backward reached the parameters of a unit whose forward belongs to an earlier "
                "pass: every forward pass releases the previous pass's gathered parameters. Run "
                "backward before the next forward of the model."
            )
        shard_grads = ctx.post_backward(call, list(grads))
        return (None, None, *shard_grads)


def autograd_running() -> bool:
    """Whether autograd's engine runs a backward on this thread (hooks.py, Note: exceptions)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is None or task_id() != -1


@dataclass(slots=True, eq=False)
class Slot:
    """Per unit: the call on the modules, the call KEPT for backward, and the open forward hooks
    (they nest: a unit called inside itself; only the outermost gathers)."""

    call: UnitCall | None = None
    kept: UnitCall | None = None
    depth: int = 0


class CallTable:
    """Per unit its `Slot`; the one place where a call changes state (Note: call states) and a
    slot's depth changes."""

    def __init__(self, units: list[Unit], *, live: UnitStats, record: StepRecord) -> None:
        self.units = units
        self.slots = [Slot() for _ in units]
        self.open = 0  # slots with depth > 0: 0 between passes
        self.live = live
        self.record = record

    def move(self, call: UnitCall, state: CallState) -> None:
        old = call.state
        assert (old, state) in LEGAL, f"ZeRO-3 internal error: unit '{call.unit.name}' {old.name} -> {state.name}"
        slot = self.slots[call.unit.uid]
        if state is S.KEPT:
            if slot.kept is not None:  # called again in this forward: one kept copy (reshard.py)
                self.move(slot.kept, S.RESHARDED)
            slot.kept = call
            self.record.add("kept", call.unit.uid)
        elif old is S.KEPT and slot.kept is call:
            slot.kept = None
        if state in (S.RESHARDED, S.DONE, S.KEPT) and slot.call is call:
            slot.call = None
            for sharded in call.unit.params:
                for module, attr in sharded.owners:
                    module.__dict__.pop(attr, None)
        elif state in (S.FORWARD, S.BACKWARD) and slot.call is None:
            for sharded, whole in zip(call.unit.params, call.wholes):
                for module, attr in sharded.owners:
                    module.__dict__[attr] = whole
            slot.call = call
        if state is S.RESHARDED or (state is S.DONE and old in (S.BACKWARD, S.KEPT)):
            with engine_mode():  # autograd keeps the tensor objects; the memory goes to the pool
                call.unit.release(call.wholes)
        elif state is S.DONE and old is S.FORWARD and not call.reduces:
            # No backward owed: the block goes back to the pool (evaluation allocates none).
            with engine_mode():
                call.unit.release(call.wholes)
            call.wholes = []
        elif state is S.DONE and old is S.RESHARDED:
            call.unit.drop_slice()  # its backward never came (reshard.py)
        elif state is S.DONE and old in (S.FORWARD, S.REDUCED_IN_FORWARD):
            call.wholes = []  # autograd may still hold them (GatherParams' outputs): they die with it
        call.state = state
        if (old in HOLDING) != (state in HOLDING):
            self.live.change(call.unit.uid, +1 if state in HOLDING else -1, call.unit.gather_in_flight)

    def set_depth(self, slot: Slot, depth: int) -> None:
        self.open += (depth > 0) - (slot.depth > 0)
        slot.depth = depth

    def is_kept(self, unit: Unit) -> bool:
        return self.slots[unit.uid].kept is not None

    def drop_leftovers(self) -> None:
        """Between passes: release kept calls and slices (a backward that still comes gathers
        again); close a call a pass that raised left on its modules (Note: exceptions)."""
        self.release_kept()
        for unit, slot in zip(self.units, self.slots):
            unit.drop_slice()
            if slot.call is not None:
                self.move(slot.call, S.DONE)

    def release_kept(self) -> None:
        for slot in self.slots:
            if slot.kept is not None:
                self.move(slot.kept, S.RESHARDED)
