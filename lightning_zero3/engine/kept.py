"""Units kept gathered across passes: the rules of `ShardedModel.gathered_for_inference()`; the
driver (`HookDriver.keep`, `release`) enters and leaves `PassState.KEPT` and moves the calls.

[Note: kept for inference]
Entry gathers every unit once (every rank, unit order) into a call that stays in FORWARD until exit;
inside, forward hooks only count their depth, so no collective runs and `generate()` runs at DDP's
speed. (docs/design.md, kept for inference)
"""

from __future__ import annotations

import torch

from lightning_zero3.engine.calls import CallState as S
from lightning_zero3.engine.calls import PassState, Slot, UnitCall, autograd_running
from lightning_zero3.engine.unit import Unit

_NO_GRAD_INSIDE = (
    "ZeRO-3: {what} inside gathered_for_inference(), where units are kept gathered without autograd "
    "(no gradient would be reduced). Run inference under torch.no_grad() or torch.inference_mode() "
    "inside the context, and train outside it."
)

UNSYNCED_HINT = (
    "This rank was in a forward without gradients. If it ran inside HF generate(), a rank whose "
    "sequences ended earlier stopped calling the model: pass synced_gpus=True to generate() on "
    "every rank (HF turns it on only for DeepSpeed and FSDP), or generate inside "
    "gathered_for_inference(), where no collective runs per token."
)


class KeptUnits:
    def __init__(self) -> None:
        self.calls: list[UnitCall] = []  # gathered by the driver's `keep`
        self.depths: list[int] = []  # open forward hooks per unit when keeping began

    def refuse_entry(self, state: PassState, open_calls: list[UnitCall | None]) -> None:
        if state is PassState.KEPT:
            raise RuntimeError("ZeRO-3: gathered_for_inference() is already active; do not nest it.")
        if (state is PassState.BACKWARD and autograd_running()) or any(
            call is None or call.reduces or call.state is not S.FORWARD for call in open_calls
        ):
            raise RuntimeError(
                "ZeRO-3: gathered_for_inference() was entered inside a backward or inside a forward with "
                "gradients enabled (e.g. a training step). Enter it in evaluation (an evaluation loop, code "
                "between steps, or around the model's call under torch.no_grad()); during training, "
                "call generate(..., synced_gpus=True) without it."
            )

    def check_forward(self, unit: Unit, slot: Slot, versions: tuple[int, ...]) -> None:
        if torch.is_grad_enabled():
            what = f"A forward of unit '{unit.name}' ran with gradients enabled"
            raise RuntimeError(_NO_GRAD_INSIDE.format(what=what))
        if not unit.params:  # a root without parameters holds nothing
            return
        call = slot.call
        assert call is not None and call.state is S.FORWARD, f"ZeRO-3 internal error: unit '{unit.name}' not kept"
        if call.versions != versions:
            raise RuntimeError(
                f"ZeRO-3: the shards of unit '{unit.name}' changed inside gathered_for_inference() (an optimizer "
                f"step or a write to the parameters): the gathered weights are stale. Change parameters "
                f"outside the context."
            )

    @staticmethod
    def refuse_backward(state: PassState) -> None:
        if state is PassState.KEPT:
            raise RuntimeError(_NO_GRAD_INSIDE.format(what="A backward ran"))
