"""Units held gathered across passes, for inference: `ShardedModel.gathered_for_inference()`.

`HeldUnits` owns which calls are held and the rules inside the context; the driver
(hooks.py, `hold` and `release`) enters and leaves `PassState.HELD` and moves the calls.

[Note: held for inference]
`ShardedModel.gathered_for_inference()` gathers every unit once, on every rank in unit order,
into a call that stays in FORWARD on its modules until the context exits (`HookDriver.hold`,
`HookDriver.release`). Inside, a unit's forward hooks only count their depth: no gather, no
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

import torch

from lightning_zero3.engine.calls import CallState as S
from lightning_zero3.engine.calls import PassState, Slot, UnitCall, autograd_running
from lightning_zero3.engine.unit import Unit

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
    """The calls `gathered_for_inference()` keeps gathered, and the rules inside the context."""

    def __init__(self) -> None:
        self.calls: list[UnitCall] = []  # gathered by the driver's `hold`
        self.depths: list[int] = []  # open forward hooks per unit when holding began

    def refuse_entry(self, state: PassState, open_calls: list[UnitCall | None]) -> None:
        """Entering is refused while nested, inside a running backward, or inside a forward
        with gradients (its units' calls owe a backward)."""
        if state is PassState.HELD:
            raise RuntimeError("ZeRO-3: gathered_for_inference() is already active; do not nest it.")
        if (state is PassState.BACKWARD and autograd_running()) or any(
            call is None or call.reduces or call.state is not S.FORWARD for call in open_calls
        ):
            raise RuntimeError(
                "ZeRO-3: gathered_for_inference() was entered inside a backward or inside a forward with "
                "gradients enabled (e.g. training_step). Enter it in evaluation (validation/test/predict "
                "steps, callbacks, or around the model's call under torch.no_grad()); during training, "
                "call generate(..., synced_gpus=True) without it."
            )

    def take_calls(self) -> list[UnitCall]:
        calls, self.calls = self.calls, []
        return calls

    def check_forward(self, unit: Unit, slot: Slot, versions: tuple[int, ...]) -> None:
        """A unit's forward inside the context: it may run on the held tensors only without
        gradients and with the shards unchanged since they were gathered."""
        if torch.is_grad_enabled():
            what = f"A forward of unit '{unit.name}' ran with gradients enabled"
            raise RuntimeError(_NO_GRAD_INSIDE.format(what=what))
        if not unit.params:  # a root without parameters holds nothing
            return
        call = slot.call
        assert call is not None and call.state is S.FORWARD, f"ZeRO-3 internal error: unit '{unit.name}' not held"
        if call.versions != versions:
            raise RuntimeError(
                f"ZeRO-3: the shards of unit '{unit.name}' changed inside gathered_for_inference() (an optimizer "
                f"step or a write to the parameters): the gathered weights are stale. Change parameters "
                f"outside the context."
            )

    @staticmethod
    def refuse_backward(state: PassState) -> None:
        if state is PassState.HELD:
            raise RuntimeError(_NO_GRAD_INSIDE.format(what="A backward ran"))
