"""Host offload (`ShardingConfig(offload="host")`).

[Note: host offload]
- Host: the registered parameters ARE the shards (pinned for a GPU), so `model.parameters()`, the
  optimizer built from it, `state_dict()` and checkpoints see host tensors; the optimizer keeps
  its state beside them and steps on the CPU; `.grad`s are host tensors too.
- Compute device: per unit one flat copy of its shards in `param_dtype` (Ψ/N in all), uploaded
  at the unit's first gather of a pass and when a host shard's version changed. A gather asking
  for a dtype (full state dicts, `gathered_parameters`, teardown) reads the host shards: exact.
  Persistent parameters and buffers stay on the compute device.
- Gradients: a unit's reduced shard gradients go to the host in one copy on this object's stream
  into the unit's staging, and into `.grad` when the backward's reductions are done (`settle`):
  one host wait per backward, on the event after the last copy (Note: staging reused).
`move_module` keeps the host shards out of `.to()`; the upload refuses shards found elsewhere.

[Note: staging reused]
One copy per unit and direction: a unit's host shards lie back to back in one (pinned) row
(shard.py, Note: shards in one buffer), so the upload copies the row at once (a cast to
`param_dtype` then runs on the device, one temporary per unit); its reduced gradients are views
of one buffer (reduce.py), copied down at once into a pinned staging row of the unit's, whose
views become `.grad` where `.grad` is None and are added into it otherwise. A row is reused
only once none of the `.grad` views made from it is alive (`zero_grad()` set them to None and
nobody kept one), so a gradient a user keeps is never overwritten; each unit keeps two rows, so
accumulation (`.grad` alive while the next backward arrives) reuses them too. Shards or gradients
not lying in one row (a `.data` replaced) are copied one by one.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_zero3.engine.buffers import current_event, stream_api
from lightning_zero3.engine.shard import ShardedParam, one_row
from lightning_zero3.engine.unit import Unit

__all__ = ["HostOffload", "move_module"]

_ROWS_KEPT = 2  # staging rows per unit (Note: staging reused)


@dataclass(eq=False)
class _Staging:
    """A unit's host row for gradients and the `.grad` views made from it."""

    row: torch.Tensor
    lent: list[weakref.ref] = field(default_factory=list)
    busy: bool = False  # copied into, not settled yet

    def free(self) -> bool:
        return not self.busy and all(view() is None for view in self.lent)


class HostOffload:
    """The device copies of host shards and the gradients on their way to the host; one per
    `ShardedModel`, handed to its units, reductions and driver when they are built."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device  # the compute device
        self.pinned = device.type == "cuda"  # pinned host memory: asynchronous copies
        # Per unit id: the device copy and the host versions it holds.
        self._copies: dict[int, torch.Tensor] = {}
        self._uploaded: dict[int, tuple[int, ...]] = {}
        self._staging: dict[int, list[_Staging]] = {}  # per unit id (Note: staging reused)
        # Downloads of this backward not yet in `.grad`: (unit, host gradients, their staging).
        self._arrived: list[tuple[Unit, list[torch.Tensor | None], _Staging | None]] = []
        self._sources: list[torch.Tensor] = []  # device gradients kept alive until the copies end
        self._api = stream_api(device)  # buffers.py, Note: stream seam
        self._stream = self._api.Stream(device) if self._api is not None else None
        self._copied: Any = None  # event after the last download (CUDA), else None
        self.uploads = 0  # device copies refreshed, for tests

    def device_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self._copies.values())

    # ---- parameters: host -> device ----------------------------------------------------------
    def close(self) -> None:
        self._copies.clear()
        self._uploaded.clear()
        self._staging.clear()
        self._arrived.clear()
        self._sources.clear()

    def begin_pass(self) -> None:  # the driver's: every pass uploads anew
        self._uploaded.clear()

    def fill(self, unit: Unit, out: torch.Tensor, *, exact: bool) -> None:
        """The unit's shards into its send row `out`: from the device copy, or with `exact` from
        the host shards."""
        if exact:
            for p, o in zip(unit.params, unit.offsets):
                out[o : o + p.shard_numel].copy_(p.param.detach())
            return
        out.copy_(self._current_copy(unit))

    def _current_copy(self, unit: Unit) -> torch.Tensor:
        versions = unit.versions()
        copy = self._copies.get(unit.uid)
        if copy is not None and self._uploaded.get(unit.uid) == versions:
            return copy
        if copy is None:
            copy = self._copies[unit.uid] = torch.empty(unit.shard_numel, dtype=unit.param_dtype, device=self.device)
        for p in unit.params:
            if p.param.device.type != "cpu":
                raise RuntimeError(
                    f"offload='host': the shard of '{p.name}' is on {p.param.device}, not in host memory: the module "
                    f"was moved with .to()/.cuda() after sharding. Do not move a sharded module; the strategy "
                    f"places it (ShardedModel.move_module)."
                )
        shards = [p.param.detach() for p in unit.params]
        row = one_row(shards, unit.offsets, unit.shard_numel)
        if row is not None:  # Note: staging reused
            copy.copy_(row, non_blocking=self.pinned)
        else:
            for shard, o in zip(shards, unit.offsets):
                copy[o : o + shard.numel()].copy_(shard, non_blocking=self.pinned)
        self._uploaded[unit.uid] = versions
        self.uploads += 1
        return copy

    # ---- gradients: device -> host -----------------------------------------------------------
    def download(self, unit: Unit, grads: list[torch.Tensor | None]) -> None:
        """Start copying the unit's reduced shard gradients to the host."""
        flat = one_row(grads, unit.offsets, unit.shard_numel)
        present = [g for g in grads if g is not None]
        if not present:
            return
        stream = self._stream
        if stream is not None:
            stream.wait_stream(self._api.current_stream(self.device))
        with self._api.stream(stream) if stream is not None else nullcontext(), torch.no_grad():
            if flat is not None:  # one copy (Note: staging reused)
                staging = self._free_staging(unit, flat.dtype)
                staging.row.copy_(flat, non_blocking=self.pinned)
                hosts = [
                    staging.row[o : o + p.shard_numel] if g is not None else None
                    for p, o, g in zip(unit.params, unit.offsets, grads)
                ]
                self._sources.append(flat)
            else:
                staging, hosts = None, []
                for grad in grads:  # one by one
                    host = None
                    if grad is not None:
                        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pinned)
                        host.copy_(grad, non_blocking=self.pinned)
                    hosts.append(host)
                self._sources.extend(present)
            self._copied = current_event(self.device) if stream is not None else None
        self._arrived.append((unit, hosts, staging))

    def _free_staging(self, unit: Unit, dtype: torch.dtype) -> _Staging:
        kept = self._staging.setdefault(unit.uid, [])
        free = next((s for s in kept if s.free() and s.row.dtype == dtype), None)
        if free is None:
            free = _Staging(torch.empty(unit.shard_numel, dtype=dtype, pin_memory=self.pinned))
            kept.append(free)
            del kept[:-_ROWS_KEPT]  # a row dropped here lives on in its `.grad` views
        free.lent.clear()
        free.busy = True
        return free

    def settle(self) -> None:
        """The backward's reductions are done: wait for the downloads, put them into `.grad`."""
        self._wait()
        with torch.no_grad():
            for unit, hosts, staging in self._arrived:
                if staging is not None:
                    staging.busy = False
                for sharded, host in zip(unit.params, hosts):
                    if host is None:
                        continue
                    param = sharded.param
                    if param.grad is None:
                        param.grad = host
                        if staging is not None:
                            staging.lent.append(weakref.ref(param.grad))
                    else:
                        param.grad.add_(host)
        self._arrived.clear()

    def drop(self) -> None:  # a backward raised
        self._wait()
        for _, _, staging in self._arrived:
            if staging is not None:
                staging.busy = False
        self._arrived.clear()

    def _wait(self) -> None:
        if self._copied is not None and self._sources:
            self._copied.synchronize()  # the host waits for the copies, not for the whole stream
        self._copied = None
        self._sources.clear()


def move_module(module: nn.Module, shards: list[ShardedParam], device: torch.device) -> None:
    """`module.to(device)` with `shards` left where they are: their slots hold None meanwhile,
    which `nn.Module._apply` skips."""
    slots = [(owner, attr, s.param) for s in shards for owner, attr in s.owners]
    for owner, attr, _ in slots:
        owner._parameters[attr] = None
    try:
        module.to(device)
    finally:
        for owner, attr, param in slots:
            owner._parameters[attr] = param
