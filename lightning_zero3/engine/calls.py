"""What one unit call is: its state, and the autograd Function whose backward Reduce-Scatters
it. `hooks.py` drives them (Note: one unit call there).

[Note: call states]
Every `UnitCall` is in one `CallState` and changes state only in `HookDriver._move` (hooks.py), which
asserts that the transition is legal and does what the move means (free the storage, count the
unit alive or not, take the tensors off the modules):

    SHARDED --gather--> FORWARD --post-forward--> RESHARDED --pre-backward--> BACKWARD --post-backward--> DONE
    FORWARD --post-forward, no backward owed (no_grad, outputs without grad)----------------> DONE
    FORWARD --post-forward of a unit that ends the forward--> KEPT --pre-backward--> BACKWARD
    FORWARD --backward inside the unit's own forward (manual optimization)--> REDUCED_IN_FORWARD
    REDUCED_IN_FORWARD --post-forward--> DONE;   RESHARDED or KEPT --backward never reached it--> DONE
    KEPT --a new pass began, the forward ended without an output needing a gradient, hooks removed--> RESHARDED
    DONE --pre-backward of a second backward (retain_graph)--> BACKWARD

Per unit the driver keeps a `Slot`: the call whose tensors are on the modules, the call kept
gathered for backward (hooks.py, Note: kept for backward), and how many forward hooks of the
unit are open (a unit called inside itself, or the owner modules of root
parameters inside the root's forward, gather once). A pass begins when a unit starts forward
while no unit is open and no backward runs; `_begin_pass` drops what an earlier pass left.
Post-forward hooks are registered with `always_call=True`, so a forward that raises closes its
unit like one that returns (hooks.py, Note: exceptions).

[Note: call lifetime]
A `UnitCall` is held by the driver while its pass may still need it (`Slot.call`, `_pending`)
and by the hooks on the unit's outputs for as long as autograd's graph lives (so backward, and
a second backward with retain_graph, find it). The autograd Functions only keep a weak
reference (and so does the hook on a frozen unit's inputs, hooks.py, Note: frozen units):
the call owns the full tensors, whose grad_fn owns the ctx, and a strong reference
from ctx to the call would close a cycle through C++ that Python's garbage collector cannot
break.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, ExitStack, nullcontext
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero3.engine.unit import Unit

if TYPE_CHECKING:
    from lightning_zero3.engine.hooks import HookDriver


class CallState(Enum):
    SHARDED = "sharded"  # created, not gathered yet
    FORWARD = "unsharded for forward"  # full parameters gathered and on the modules
    RESHARDED = "resharded, awaiting backward"  # storage freed, autograd keeps the tensor objects
    KEPT = "kept unsharded for backward"  # ends the forward: not released, off the modules
    BACKWARD = "unsharded for backward"  # gathered again (or kept) for the unit's backward
    REDUCED_IN_FORWARD = "reduced inside its forward"  # manual optimization: still on the modules
    DONE = "done"  # nothing held, no backward owed


S = CallState  # short name for the tables below
LEGAL = {
    (S.SHARDED, S.FORWARD), (S.FORWARD, S.RESHARDED), (S.FORWARD, S.DONE),
    (S.FORWARD, S.REDUCED_IN_FORWARD), (S.REDUCED_IN_FORWARD, S.DONE), (S.RESHARDED, S.BACKWARD),
    (S.RESHARDED, S.DONE), (S.BACKWARD, S.DONE), (S.DONE, S.BACKWARD),
    (S.FORWARD, S.KEPT), (S.KEPT, S.BACKWARD), (S.KEPT, S.RESHARDED), (S.KEPT, S.DONE),
}  # fmt: skip
HOLDING = (S.FORWARD, S.KEPT, S.BACKWARD, S.REDUCED_IN_FORWARD)  # states whose storage is filled


class UnitCall:
    """One forward execution of a unit and the full tensors it produced."""

    def __init__(self, unit: Unit, *, reduces: bool) -> None:
        self.unit = unit
        self.reduces = reduces  # produced by _GatherParams: its backward Reduce-Scatters
        self.fulls: list[torch.Tensor] = []
        self.state = CallState.SHARDED
        # Shard versions when gathered: an optimizer step in between makes the fulls stale.
        self.versions: tuple[int, ...] = ()


def engine_mode() -> AbstractContextManager[object]:
    """Inference mode off, gradients off, for the engine's own tensors (hooks.py, Note: inference mode)."""
    if not torch.is_inference_mode_enabled():
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())  # leaving inference mode would enable gradients
    return stack


class GatherParams(torch.autograd.Function):
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


def autograd_running() -> bool:
    """Whether autograd's engine is executing a backward on this thread (hooks.py, Note: exceptions)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is None or task_id() != -1


class Slot:
    """Per unit: the call whose full tensors are on the modules, the call kept gathered for
    backward (state KEPT, off the modules), and the open forward hooks."""

    __slots__ = ("call", "kept", "depth")

    def __init__(self) -> None:
        self.call: UnitCall | None = None
        self.kept: UnitCall | None = None
        self.depth = 0
