"""What a unit keeps from its forward to its backward: `reshard_after_forward`, FSDP2's option
with FSDP2's meaning; the driver asks `after_forward` at each post-forward owing a backward.

[Note: reshard after forward]
- True (default): the call is RESHARDED and its backward gathers again, except the units
  backward begins with (hooks.py, Note: kept for backward). All-Gather payload ~2Ψ per step.
- False: every such call is KEPT until its backward, which gathers nothing (payload Ψ; every unit
  alive at the end of forward, as with DDP). A unit called twice keeps its latest call only.
- An int G (dividing the shard group): the unit keeps this rank's 1/G slice (`Unit.keep_slice`)
  and its backward All-Gathers the slices inside its group of G consecutive ranks (DeepSpeed's
  hpZ): the payload of True, the backward half inside the group. The slice goes when a gather
  uses it, when a backward ends without it, or when a pass begins; one cut before an optimizer
  step is stale (the gather then runs over the shard group). A rank leaving the recorded order in
  backward announces it inside its group only; the other groups fail at their next collective.
"""

from __future__ import annotations

from lightning_zero3.engine.calls import CallState, CallTable, UnitCall, engine_mode

__all__ = ["after_forward", "resolve"]


def resolve(setting: bool | int, *, shard_group: int) -> bool | int:
    """`reshard_after_forward` against the shard group's size: G equal to it is True."""
    if type(setting) is bool or setting == shard_group:
        return bool(setting)
    if shard_group % setting:
        raise ValueError(
            f"reshard_after_forward={setting} must divide the shard group of {shard_group} ranks (the world "
            f"size, or shard_size): the slice kept after forward is gathered inside groups of that many "
            f"consecutive ranks. Pick a divisor such as the processes per node, or True/False."
        )
    return setting


def after_forward(setting: bool | int, call: UnitCall, calls: CallTable, *, ends_forward: bool) -> None:
    """Note: reshard after forward."""
    if setting is False or ends_forward:
        calls.move(call, CallState.KEPT)
        return
    if setting is not True:
        with engine_mode():
            call.unit.keep_slice(call.wholes)
    calls.move(call, CallState.RESHARDED)
