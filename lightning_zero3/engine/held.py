"""Units held gathered across passes, for inference: `ShardedModel.gathered_for_inference()`.

`HeldUnits` owns which calls are held and the rules inside the context. It is a part of the
hook driver (hooks.py) kept in its own file: it works on the driver's slots and moves calls
only through the driver's `_move` (calls.py, Note: call states).

[Note: held for inference]
`ShardedModel.gathered_for_inference()` gathers every unit once, on every rank in unit order,
into a call that stays in FORWARD on its modules until the context exits (`HeldUnits.hold`,
`HeldUnits.release`). Inside, a unit's forward hooks only count their depth: no gather, no
release, no prefetch, no collective at all, so `generate()` runs at DDP's speed and a rank that
stops early (EOS) leaves the others nothing to wait for. Entered inside a forward without
gradients (Lightning runs predict_step inside the root's forward), the units already open keep
their own calls, which their post-forward hooks close as usual. Gradients are refused: entering
inside a forward with gradients, a grad-enabled forward or a backward inside raise (held tensors
have no autograd parent and would get no Reduce-Scatter), and so does a forward after the shards
changed (an optimizer step inside). Exit moves every call it gathered to DONE whatever
happened inside, and the next pass starts afresh.
Outside the context, HF generation stays in step only with `synced_gpus=True`, which the
engine fills in when the caller leaves it unset (generation.py, Note: synced generation by
default). With an explicit `synced_gpus=False`, a rank that stopped early leaves the others
waiting in a gather. Such a gather's error, in a pass without gradients, says so
(`UNSYNCED_HINT`); the rank that stopped cannot be told, it is no longer in the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_zero3.engine.calls import CallState as S
from lightning_zero3.engine.calls import Slot, UnitCall, autograd_running
from lightning_zero3.engine.unit import Unit

if TYPE_CHECKING:
    from lightning_zero3.engine.hooks import HookDriver


_NO_GRAD_INSIDE = (
    "ZeRO-3: {what} inside gathered_for_inference(), where units are held gathered without autograd "
    "(no gradient would be reduced). Run inference under torch.no_grad() or torch.inference_mode() "
    "inside the context, and train outside it."
)

# Added to a failed gather of a pass without gradients: the usual cause is HF `generate()`.
UNSYNCED_HINT = (
    "This rank was in a forward without gradients. If it ran inside HF generate(), a rank whose "
    "sequences ended earlier stopped calling the model: pass synced_gpus=True to generate() on "
    "every rank (HF turns it on only for DeepSpeed and FSDP), or generate inside "
    "gathered_for_inference(), where no collective runs per token."
)


class HeldUnits:
    """The calls `gathered_for_inference()` keeps gathered, and what the hooks do meanwhile."""

    def __init__(self, driver: HookDriver) -> None:
        self.driver = driver
        # Calls kept gathered by `hold` (None: not holding).
        self.calls: list[UnitCall] | None = None
        self._depths: list[int] = []  # open forward hooks per unit when holding began

    @property
    def active(self) -> bool:
        return self.calls is not None

    def hold(self) -> None:
        """Gather every unit into a call that stays in FORWARD until `release`. Collective.
        Inside a forward without gradients (Lightning's predict_step runs inside the root's
        forward), the units already open keep their calls and stay the open pass's."""
        driver = self.driver
        if self.calls is not None:
            raise RuntimeError("ZeRO-3: gathered_for_inference() is already active; do not nest it.")
        open_calls = [slot.call for unit, slot in zip(driver.units, driver._slots) if slot.depth and unit.params]
        if (driver._in_backward and autograd_running()) or any(
            call is None or call.reduces or call.state is not S.FORWARD for call in open_calls
        ):
            raise RuntimeError(
                "ZeRO-3: gathered_for_inference() was entered inside a backward or inside a forward with "
                "gradients enabled (e.g. training_step). Enter it in evaluation (validation/test/predict "
                "steps, callbacks, or around the model's call under torch.no_grad()); during training, "
                "call generate(..., synced_gpus=True) without it."
            )
        if driver._in_backward:
            driver._abandon_backward()
        if driver._open:  # inside a forward: its units keep their calls
            driver._release_stale_prefetches()
        else:
            driver._begin_pass()  # drops prefetches and what an earlier pass left on the modules
        self._depths = [slot.depth for slot in driver._slots]
        self.calls = []
        try:
            with torch.no_grad():  # reduces=False: the held tensors have no autograd parent
                for unit in driver.units:
                    if unit.params and driver._slots[unit.uid].call is None:
                        self.calls.append(driver._gather_call(unit))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Move every call `hold` gathered to DONE; those units are sharded again. Calls of an
        enclosing forward stay for its post-forward hooks."""
        held, self.calls = self.calls or [], None
        for call in held:
            if call.state is S.FORWARD:
                self.driver._move(call, S.DONE)
        for slot, depth in zip(self.driver._slots, self._depths):
            self.driver._set_depth(slot, depth)  # as on entry: the forward hooks inside came in pairs

    def pre_forward(self, unit: Unit, slot: Slot) -> None:
        """A unit's forward inside the context: check it may run on the held tensors."""
        if torch.is_grad_enabled():
            what = f"A forward of unit '{unit.name}' ran with gradients enabled"
            raise RuntimeError(_NO_GRAD_INSIDE.format(what=what))
        if not unit.params:  # a root without parameters holds nothing
            self.driver._set_depth(slot, slot.depth + 1)
            return
        call = slot.call
        assert call is not None and call.state is S.FORWARD, f"ZeRO-3 internal error: unit '{unit.name}' not held"
        if call.versions != self.driver._versions(unit):
            raise RuntimeError(
                f"ZeRO-3: the shards of unit '{unit.name}' changed inside gathered_for_inference() (an optimizer "
                f"step or a write to the parameters): the gathered weights are stale. Change parameters "
                f"outside the context."
            )
        self.driver._set_depth(slot, slot.depth + 1)

    def post_forward(self, slot: Slot) -> None:
        self.driver._set_depth(slot, max(slot.depth - 1, 0))  # the call stays in FORWARD

    def refuse_backward(self) -> None:
        if self.calls is not None:
            raise RuntimeError(_NO_GRAD_INSIDE.format(what="A backward ran"))
