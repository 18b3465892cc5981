"""Host offload (`ShardingConfig(offload="host")`): the shards, their gradients and the optimizer
state in host memory, the optimizer step on the CPU; the compute device keeps what gathers need.

[Note: host offload]
What lives where, per rank (Ψ parameters, N ranks, fp32 shards):
- Host: the registered parameters ARE the fp32 shards (Ψ/N each; pinned memory when the compute
  device is a GPU), so `model.parameters()`, the optimizer built from it (Lightning's
  `configure_optimizers`, `fabric.setup`), `state_dict()` and checkpoints see host tensors, and
  the optimizer allocates its state next to them and steps on the CPU. Nothing rewrites param
  groups. Their `.grad`s are host tensors too.
- Compute device: per unit one flat copy of its shards in `param_dtype` (`HostOffload._copies`,
  Ψ/N in all), uploaded at the unit's first gather of each pass (`begin_pass`) and again when a
  host shard's version changed since the upload (an optimizer step inside a pass); gathers
  copy it into their send row. A gather that asks for a dtype (`Unit.gather(dtype=...)`: full
  state dicts, `gathered_parameters`, the restore at teardown) reads the host shards themselves,
  so it is exact and never sees a copy older than the last write. Persistent parameters
  (`persistence_threshold`) and buffers stay on the compute device, whole, as without offload.
- Gradients: each unit's reduced shard gradients are copied to fresh host tensors (pinned on a
  GPU, on a stream of this object's that first waits for the compute stream), and become or are
  added into `.grad` once the backward's reductions are done (`settle`, from
  `Reductions.finish_all`): the one host wait of a backward, before the optimizer step that
  needs them. Nothing on the per-unit path waits on the host.
A module moved with `.to(device)` would move the host shards: `keep_on_host` hides them from
`nn.Module._apply` while the strategies place the rest (`ShardedModel.move_module`), and the
upload refuses shards found off the host.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from lightning_zero3.engine.calls import PassState
from lightning_zero3.engine.hooks import HookDriver
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.unit import Unit

__all__ = ["HostOffload", "OffloadHooks", "keep_on_host", "move_module"]


class HostOffload:
    """The device copies of host shards and the gradients on their way to host memory (Note:
    host offload). One per `ShardedModel`; every unit's `offload` points to it."""

    def __init__(self, units: list[Unit], *, device: torch.device) -> None:
        self.device = device  # the compute device
        self.pinned = device.type == "cuda"  # pinned host memory: asynchronous copies
        # Per unit id: the flat device copy in `param_dtype`, and the host versions it holds.
        self._copies: dict[int, torch.Tensor] = {}
        self._uploaded: dict[int, tuple[int, ...]] = {}
        # Downloads of this backward not yet in `.grad`: (shard, host gradient).
        self._arrived: list[tuple[ShardedParam, torch.Tensor]] = []
        self._sources: list[torch.Tensor] = []  # device gradients kept alive until the copies end
        self._stream = torch.cuda.Stream(device) if self.pinned else None
        self.uploads = 0  # device copies refreshed, for tests
        for unit in units:
            unit.offload = self

    def device_bytes(self) -> int:
        """Bytes of the device copies alive."""
        return sum(c.numel() * c.element_size() for c in self._copies.values())

    # ---- parameters: host -> device ----------------------------------------------------------
    def close(self) -> None:
        """Free the device copies and the gradients in transit (the run ended: `remove_hooks`)."""
        self._copies.clear()
        self._uploaded.clear()
        self._arrived.clear()
        self._sources.clear()

    def begin_pass(self) -> None:
        """A pass begins: every device copy is refreshed at its unit's next gather."""
        self._uploaded.clear()

    def fill(self, unit: Unit, out: torch.Tensor, *, exact: bool) -> None:
        """Write the unit's shards, cast to `out`'s dtype, into `out` (its send row, on the
        compute device): from the device copy, or with `exact` from the host shards."""
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
        """Start copying the unit's reduced shard gradients (None: no gradient) to host memory;
        `settle` puts them into `.grad`."""
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for sharded, grad in zip(unit.params, grads):
                if grad is None:
                    continue
                host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pinned)
                host.copy_(grad, non_blocking=self.pinned)
                self._arrived.append((sharded, host))
                self._sources.append(grad)

    def settle(self) -> None:
        """The backward's reductions are done: wait for the downloads (once) and add them into
        the shards' `.grad` (a gradient becomes `.grad` where there is none)."""
        self._wait()
        with torch.no_grad():
            for sharded, host in self._arrived:
                param = sharded.param
                if param.grad is None:
                    param.grad = host
                else:
                    param.grad.add_(host)
        self._arrived.clear()

    def drop(self) -> None:
        """A backward that raised: the downloads finish and are dropped."""
        self._wait()
        self._arrived.clear()

    def _wait(self) -> None:
        if self._stream is not None and self._sources:
            self._stream.synchronize()
        self._sources.clear()


class OffloadHooks(HookDriver):
    """The hook driver with host offload: each pass begins by marking the device copies of
    the host shards for refresh (Note: host offload)."""

    def _begin_pass(self, state: PassState = PassState.FORWARD) -> None:
        offload = self.units[0].offload
        assert isinstance(offload, HostOffload)
        offload.begin_pass()
        super()._begin_pass(state)


@contextmanager
def keep_on_host(shards: list[ShardedParam]) -> Iterator[None]:
    """Inside the block, `shards` are not registered on their modules (each slot holds None,
    which `nn.Module._apply` skips), so moving the module leaves them in host memory."""
    slots = [(module, attr, s.param) for s in shards for module, attr in s.owners]
    for module, attr, _ in slots:
        module._parameters[attr] = None
    try:
        yield
    finally:
        for module, attr, param in slots:
            module._parameters[attr] = param


def move_module(module: nn.Module, shards: list[ShardedParam], device: torch.device) -> None:
    """`module.to(device)` with `shards` left where they are (Note: host offload)."""
    with keep_on_host(shards):
        module.to(device)
