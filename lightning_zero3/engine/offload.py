"""Host offload (`ShardingConfig(offload="host")`).

[Note: host offload]
- Host: the registered parameters ARE the shards (pinned for a GPU), so `model.parameters()`, the
  optimizer built from it, `state_dict()` and checkpoints see host tensors; the optimizer keeps
  its state beside them and steps on the CPU; `.grad`s are host tensors too.
- Compute device: per unit one flat copy of its shards in `param_dtype` (Ψ/N in all), uploaded
  at the unit's first gather of a pass and when a host shard's version changed. A gather asking
  for a dtype (full state dicts, `gathered_parameters`, teardown) reads the host shards: exact.
  Persistent parameters and buffers stay on the compute device.
- Gradients: reduced shard gradients are copied to fresh host tensors on this object's stream and
  go into `.grad` when the backward's reductions are done (`settle`): one host wait per backward.
`move_module` keeps the host shards out of `.to()`; the upload refuses shards found elsewhere.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from lightning_zero3.engine.buffers import stream_api
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.unit import Unit

__all__ = ["HostOffload", "move_module"]


class HostOffload:
    """The device copies of host shards and the gradients on their way to the host; one per
    `ShardedModel`, handed to its units, reductions and driver when they are built."""

    def __init__(self, *, device: torch.device) -> None:
        self.device = device  # the compute device
        self.pinned = device.type == "cuda"  # pinned host memory: asynchronous copies
        # Per unit id: the device copy and the host versions it holds.
        self._copies: dict[int, torch.Tensor] = {}
        self._uploaded: dict[int, tuple[int, ...]] = {}
        # Downloads of this backward not yet in `.grad`: (shard, host gradient).
        self._arrived: list[tuple[ShardedParam, torch.Tensor]] = []
        self._sources: list[torch.Tensor] = []  # device gradients kept alive until the copies end
        self._api = stream_api(device)  # buffers.py, Note: stream seam
        self._stream = self._api.Stream(device) if self._api is not None else None
        self.uploads = 0  # device copies refreshed, for tests

    def device_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self._copies.values())

    # ---- parameters: host -> device ----------------------------------------------------------
    def close(self) -> None:
        self._copies.clear()
        self._uploaded.clear()
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
        for p, o in zip(unit.params, unit.offsets):
            if p.param.device.type != "cpu":
                raise RuntimeError(
                    f"offload='host': the shard of '{p.name}' is on {p.param.device}, not in host memory: the module "
                    f"was moved with .to()/.cuda() after sharding. Do not move a sharded module; the strategy "
                    f"places it (ShardedModel.move_module)."
                )
            copy[o : o + p.shard_numel].copy_(p.param.detach(), non_blocking=self.pinned)
        self._uploaded[unit.uid] = versions
        self.uploads += 1
        return copy

    # ---- gradients: device -> host -----------------------------------------------------------
    def download(self, unit: Unit, grads: list[torch.Tensor | None]) -> None:
        """Start copying the unit's reduced shard gradients to the host."""
        stream = self._stream
        if stream is not None:
            stream.wait_stream(self._api.current_stream(self.device))
        with self._api.stream(stream) if stream is not None else nullcontext():
            for sharded, grad in zip(unit.params, grads):
                if grad is None:
                    continue
                host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pinned)
                host.copy_(grad, non_blocking=self.pinned)
                self._arrived.append((sharded, host))
                self._sources.append(grad)

    def settle(self) -> None:
        """The backward's reductions are done: wait for the downloads, put them into `.grad`."""
        self._wait()
        with torch.no_grad():
            for sharded, host in self._arrived:
                param = sharded.param
                if param.grad is None:
                    param.grad = host
                else:
                    param.grad.add_(host)
        self._arrived.clear()

    def drop(self) -> None:  # a backward raised
        self._wait()
        self._arrived.clear()

    def _wait(self) -> None:
        if self._stream is not None and self._sources:
            self._stream.synchronize()
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
