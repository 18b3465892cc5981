"""What a unit keeps from its forward to its backward: `reshard_after_forward` (config.py),
FSDP2's option with FSDP2's meaning. The driver (hooks.py) asks `after_forward` at each
post-forward of a call that owes a backward; `resolve` and `slice_group` set it up once
(model.py).

[Note: reshard after forward]
- True (default): the call's full parameters are released (RESHARDED) and its backward gathers
  them again over the shard group, except for the units backward begins with (the root and the
  last unit: hooks.py, Note: kept for backward), which are KEPT. All-Gather payload per step
  ~2Ψ - Ψ_root - Ψ_last; live units: the computing one, the prefetched ones and the kept ones.
- False: every such call is KEPT: whole from its forward to its backward, which gathers
  nothing (All-Gather payload Ψ per step; every unit's full parameters alive at the end of
  forward, as with DDP). A unit called again in the same forward keeps only its latest call;
  the earlier call goes RESHARDED and its backward gathers again (one full copy per unit, as
  FSDP2 keeps one unsharded copy per module).
- An int G (1 < G < shard group, dividing it): the call is RESHARDED, but first the unit keeps
  this rank's 1/G slice of its full parameters (`Unit.keep_slice`: the shards of N/G ranks of
  each parameter, in `param_dtype`) and its backward All-Gathers the slices inside this rank's
  group of G consecutive ranks (e.g. one node: DeepSpeed's hpZ, FSDP2's int). The payload is
  the same as with True; what moves is where it crosses: the backward half stays in the group.
  The slice is freed when a gather uses it (the backward's, or its prefetch), at the end of the
  backward that did not reach it, or when the next pass begins; a slice cut before the shards
  changed (an optimizer step in between) is stale and dropped, the gather then runs over the
  shard group. A unit called twice in one forward keeps one slice: the later backward uses it,
  the earlier gathers over the shard group. The root and last unit are kept whole as with True.
  G = shard group is True; G = 1 is refused (False is its name). A rank that leaves the
  recorded order in backward announces it in its group of G only (departure.py): that group
  raises `OrderMismatchError` (its ranks numbered within the group); the other groups fail at
  their next collective over the shard group, with a `CollectiveError` once the departed ranks
  exit (under NCCL, after the timeout).
Passes without a backward never keep anything past their end: a forward without gradients
owes no backward (its calls go DONE), and what a grad-enabled forward kept is released when its
output needs no gradient, when the next pass begins, or when the hooks go (hooks.py).
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_zero3.engine.calls import CallState, CallTable, UnitCall, engine_mode
from lightning_zero3.engine.comm import consecutive_group

__all__ = ["after_forward", "resolve", "slice_group"]


def resolve(setting: bool | int, *, shard_group: int) -> bool | int:
    """`reshard_after_forward` against the shard group's size (`shard_size`, or the world):
    an int G equal to it is True; one that does not divide it is refused on every rank alike."""
    if type(setting) is bool or setting == shard_group:
        return bool(setting)
    if shard_group % setting:
        raise ValueError(
            f"reshard_after_forward={setting} must divide the shard group of {shard_group} ranks (the world "
            f"size, or shard_size): the slice kept after forward is gathered inside groups of that many "
            f"consecutive ranks. Pick a divisor such as the processes per node, or True/False."
        )
    return setting


def slice_group(setting: bool | int) -> dist.ProcessGroup | None:
    """This rank's group of G consecutive ranks for an int `setting` (resolved), else None.
    Every rank must call it (creating groups is collective)."""
    return consecutive_group(setting) if type(setting) is int else None


def after_forward(setting: bool | int, call: UnitCall, calls: CallTable, *, ends_forward: bool) -> None:
    """A call that owes a backward ends its forward: keep it whole (KEPT), or release it
    (RESHARDED), keeping its unit's slice first with an int setting (Note: reshard after forward)."""
    if setting is False or ends_forward:
        calls.move(call, CallState.KEPT)
        return
    if setting is not True:
        with engine_mode():
            call.unit.keep_slice(call.fulls)
    calls.move(call, CallState.RESHARDED)
