"""Shard a module's parameters one module at a time, so no rank ever holds the whole model (built
whole or on the meta device), and back (`restore_whole`, one unit at a time).

[Note: one consistent whole tensor]
Every rank's shard must be a slice of one whole tensor, and ranks may have initialised their
copies differently, so rank 0's values are broadcast before slicing, one module's own tensors at
a time (DDP's rule, with a peak of one module). Meta modules are materialised and initialised by
`param_init_fn` (default `reset_parameters()`) on every rank, then rank 0's result is broadcast.

[Note: shards before whole tensors]
On the host, glibc serves shards and transient whole tensors from one heap; made in turn, each
long-lived shard lands between freed whole tensors, holes the heap cannot return (setup grew by
~2.6x the shards, 24 x 16 MiB layers on 2 ranks). So every shard is allocated first and one
module's whole tensors come and go above them (tests/lightning/test_setup_memory.py).

[Note: sharding from host memory]
A model whole in host memory is sharded from there: each module's own parameters visit the
target device only to be broadcast and cut, so it never holds more than the shards and one
module; persistent parameters and buffers move for good. So the strategy does not move the
module before sharding (strategy.py, `model_to_device`).

[Note: memory shared by ranks]
A multiprocessing launcher started by forkserver hands every rank the parent's module with its
CPU tensors in shared memory (Lightning's makes private copies for spawn only). What stays whole
(persistent parameters, buffers) is then one tensor that every rank updates in place: steps and
running statistics applied once per rank, racing. So each becomes this rank's own copy here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.plan import ParamEntry, Plan
from lightning_zero3.engine.shard import ShardedParam, shard_numel, shard_slice, tensors_in_one_row
from lightning_zero3.engine.unit import Unit

ParamInitFn = Callable[[nn.Module], None]


def reset_parameters(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        names = [n for n, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
        raise ValueError(
            f"{type(module).__name__} has tensors {names} on the meta device but no reset_parameters() to "
            f"initialise them. Pass param_init_fn=callable(module) that initialises a module's own parameters "
            f"and buffers."
        )
    reset()


@contextmanager
def parameters_on_meta(device: torch.device | str) -> Iterator[None]:
    """Build modules with their parameters on the meta device and every other tensor in host
    memory, for a model that will run on `device`: sharding moves buffers there one module at a
    time, `ShardedModel.move_module` the rest (e.g. torchmetrics' states).

    [Note: only parameters on meta]
    Under a plain `torch.device("meta")` tensors that are not parameters lose their values (buffers
    computed in `__init__`, torchmetrics' states), and nothing re-creates them. (docs/design.md, only
    parameters on meta)"""
    del device  # nothing is built there (the Note); kept so callers name where the model runs

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta or type(param) is not nn.Parameter:
            return None  # keep it as it is: already deferred, or a subclass (lazy, quantised) we cannot rebuild
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    # torch annotates the hook as returning None; a returned Parameter replaces the registered one.
    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]
    try:
        with torch.device("cpu"):
            yield
    finally:
        handle.remove()


def shard_parameters(
    root: nn.Module,
    plan: Plan,
    *,
    comm: Comm,
    world_comm: Comm,
    device: torch.device,
    param_init_fn: ParamInitFn | None = None,
    sync_module_states: bool = True,
    on_host: bool = False,
) -> dict[int, ShardedParam]:
    """Replace every planned parameter of `root` by this rank's shard, module by module; the
    shards by `id(entry)`. With `on_host` in host memory, pinned for a GPU (offload.py)."""
    _raise_if_meta_state(root)  # before any collective: every rank has the same model
    init = param_init_fn or reset_parameters
    entry_of = {(id(m), a): entry for unit in plan.units for entry in unit.params for m, a in entry.owners}
    persistent_entry_of = {(id(m), a): entry for entry in plan.persistent for m, a in entry.owners}
    # Note: shards before whole tensors
    home = torch.device("cpu") if on_host else device
    pin = on_host and device.type == "cuda"
    storage = {id(e): shard for unit in plan.units for e, shard in _shard_storage(unit.params, comm, home, pin=pin)}
    shards: dict[int, ShardedParam] = {}

    def shard_own_tensors(module: nn.Module) -> None:
        """Broadcast and cut this module's own whole tensors (a tied parameter once)."""
        own = [
            (attr, p, _on(p, device, keep=(id(module), attr) in persistent_entry_of))
            for attr, p in module._parameters.items()
            if p is not None
            and ((id(module), attr) in persistent_entry_of or id(entry_of.get((id(module), attr))) not in shards)
        ]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)
            elif buffer is not None and _shared_by_ranks(buffer):
                module._buffers[name] = buffer.clone()  # Note: memory shared by ranks
        buffers = [b for b in module._buffers.values() if b is not None]
        if sync_module_states and world_comm.world_size > 1:
            _broadcast_from_rank0([whole for _, _, whole in own] + buffers, world_comm)
        for attr, param, whole in own:
            planned = entry_of.get((id(module), attr))
            if planned is None:
                continue  # persistent: stays whole on every rank
            shards[id(planned)] = _shard(whole, param, planned, comm, into=storage.pop(id(planned)))

    for module in root.modules():
        if any(t is not None and t.is_meta for t in [*module._parameters.values(), *module._buffers.values()]):
            tied = [a for a, p in module._parameters.items() if p is not None and not p.is_meta]
            if tied:
                raise ValueError(
                    f"{type(module).__name__} has parameters on the meta device and also {tied}, already "
                    f"initialised through another module (tied weights). Tie the weights after sharding's "
                    f"initialisation, or build this model off the meta device."
                )
            meta_buffers = {n: b for n, b in module._buffers.items() if b is not None and b.is_meta}
            _materialize_meta_tensors(module, device)
            versions = {n: _version(module, n) for n in meta_buffers}
            with torch.no_grad():
                init(module)
            _tie_persistent(module, persistent_entry_of)
            untouched = [n for n in meta_buffers if _version(module, n) == versions[n]]
            if untouched:
                warnings.warn(
                    f"{type(module).__name__}: buffers {untouched} were created on the meta device and the "
                    f"initialisation did not write them, so they hold uninitialised memory. Recreate them in "
                    f"param_init_fn (e.g. a rotary inv_freq or a causal mask computed in __init__).",
                    stacklevel=2,
                )
        shard_own_tensors(module)
    missing = [e.names[0] for u in plan.units for e in u.params if id(e) not in shards]
    assert not missing, f"parameters not reached while sharding: {missing}"
    return shards


def _shard_storage(
    entries: list[ParamEntry], comm: Comm, device: torch.device, *, pin: bool = False
) -> list[tuple[ParamEntry, torch.Tensor]]:
    """Memory for one unit's shards (shard.py, Note: shards in one buffer); one tensor each
    where the unit mixes dtypes (which `Unit` refuses)."""
    dtypes = {e.param.dtype for e in entries}
    numels = [shard_numel(e.param.numel(), comm.world_size) for e in entries]
    if len(dtypes) != 1:
        return [(e, torch.empty(n, dtype=e.param.dtype, device=device)) for e, n in zip(entries, numels)]
    dtype = entries[0].param.dtype
    return list(zip(entries, tensors_in_one_row(numels, sum(numels), dtype, device, pin=pin)))


def _tie_persistent(module: nn.Module, persistent_entry_of: dict[tuple[int, str], ParamEntry]) -> None:
    """A persistent parameter `module` just materialised replaces the meta one on every owner,
    so tied weights stay one parameter (`_shard` does so for planned ones)."""
    for attr, param in module._parameters.items():
        entry = persistent_entry_of.get((id(module), attr))
        if entry is None or param is None:
            continue
        entry.param = param
        for owner, owner_attr in entry.owners:
            owner._parameters[owner_attr] = param


def _version(module: nn.Module, buffer: str) -> int:
    tensor = module._buffers[buffer]
    assert tensor is not None
    return tensor._version


# The end of the message above; the strategies name their own ways to the same (common/options.py).
META_FIX = (
    "Build the model under lightning_zero3.engine.materialize.parameters_on_meta(device), which defers only "
    'parameters, not under torch.device("meta").'
)


def _raise_if_meta_state(root: nn.Module) -> None:
    """Refuse meta tensors that are not parameters or buffers (one level into lists and dicts)."""
    found = []
    for name, module in root.named_modules():
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers"):
                continue
            values = list(value.values()) if isinstance(value, dict) else value
            values = values if isinstance(values, list | tuple) else [values]
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
                found.append(f"{name}.{attr}" if name else attr)
    if found:
        raise ValueError(
            f"{found[:5]} are tensors on the meta device that are neither parameters nor buffers (e.g. "
            f"torchmetrics states), so their values cannot be restored when the model is sharded. {META_FIX}"
        )


def _materialize_meta_tensors(module: nn.Module, device: torch.device) -> None:
    """Uninitialised memory on `device` for `module`'s own meta tensors (`to_empty` would
    replace its real tensors too)."""
    for name, param in list(module._parameters.items()):
        if param is not None and param.is_meta:
            setattr(module, name, nn.Parameter(torch.empty_like(param, device=device), param.requires_grad))
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and buffer.is_meta:
            setattr(module, name, torch.empty_like(buffer, device=device))


# Tensors this large are broadcast in place; smaller ones of a module are packed into one.
_BROADCAST_IN_PLACE_BYTES = 2**20


def _broadcast_from_rank0(tensors: list[torch.Tensor], comm: Comm) -> None:
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_contiguous() and t.numel() * t.element_size() >= _BROADCAST_IN_PLACE_BYTES:
            comm.broadcast(t, src=0, what="initial model states")  # in place: no copy
            continue
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        comm.broadcast(flat, src=0, what="initial model states")
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _on(param: nn.Parameter, device: torch.device, *, keep: bool) -> torch.Tensor:
    """`param`'s values on `device`: moved for good with `keep` (Note: sharding from host memory)."""
    if param.device == device:
        if keep and _shared_by_ranks(param):
            param.data = param.data.clone()  # Note: memory shared by ranks
        return param.data
    if keep:
        param.data = param.data.to(device)
        return param.data
    return param.detach().to(device)


def _shared_by_ranks(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_shared()  # a CUDA tensor always says shared


def _shard(
    whole: torch.Tensor, param: nn.Parameter, entry: ParamEntry, comm: Comm, *, into: torch.Tensor
) -> ShardedParam:
    with torch.no_grad():
        into.copy_(shard_slice(whole, comm.rank, comm.world_size))
    shard = nn.Parameter(into, requires_grad=param.requires_grad)
    for module, attr in entry.owners:
        module._parameters[attr] = shard
    entry.param = shard  # the plan must not keep the whole tensor alive
    return ShardedParam(
        owners=entry.owners,
        names=entry.names,
        whole_shape=whole.shape,
        param=shard,
        world_size=comm.world_size,
        rank=comm.rank,
    )


def restore_whole(units: list[Unit], *, device: torch.device) -> None:
    """Register whole parameters, built on `device`, in place of the shards. Collective.

    [Note: restoring unit by unit]
    Units are gathered one at a time on the shards' device (which so holds one unit more) into
    one pooled block and copied out, every output allocated first (Note: shards before whole
    tensors): per-unit blocks freed on glibc's heap kept +16 MiB per 16 MiB unit resident."""
    outputs = {
        id(sharded): torch.empty(sharded.whole_shape, dtype=unit.shard_dtype, device=device)
        for unit in units
        for sharded in unit.params
    }
    for unit in units:
        if not unit.params:
            continue
        whole = [outputs.pop(id(sharded)) for sharded in unit.params]
        unit.gather_into(whole, dtype=unit.shard_dtype)
        for sharded, tensor in zip(unit.params, whole):
            param = nn.Parameter(tensor, requires_grad=sharded.requires_grad)
            for module, attr in sharded.owners:
                module.register_parameter(attr, param)  # tied weights stay tied
