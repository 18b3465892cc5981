"""Loading into a live model at this run's world size: checks first (agreed by every rank),
then one DCP load in which each rank reads only the chunks that overlap its new shards."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_zero3.checkpoint.errors import CheckpointError, require_exists, run_and_agree
from lightning_zero3.checkpoint.files import few
from lightning_zero3.checkpoint.format import (
    Pieces,
    ShardedCheckpoint,
    ShardedOptimizerStates,
    ShardedStateDict,
    check_fits,
    dtype_of,
    model_tensors,
    numbered_optimizer_state,
    open_sharded,
    optimizer_param_names,
    sharded_by_name,
)
from lightning_zero3.checkpoint.full import load_full
from lightning_zero3.checkpoint.remote import RemotePath
from lightning_zero3.engine import ShardedModel, ShardedParam, load_full_optimizer_state, note_shard_writes


def open_checked(
    path: str | os.PathLike | RemotePath,
    model: ShardedModel,
    *,
    strict: bool,
    context: str,
    trusted: bool,
    verify: bool = True,
) -> ShardedCheckpoint:
    """`open_sharded`, checked to fit `model`; every rank raises if any rank found a problem."""
    ckpt = open_sharded(path, comm=model.world_comm, verify=verify, trusted=trusted)
    expected = model_tensors(model)
    run_and_agree(
        model.world_comm, lambda: check_fits(ckpt.path, ckpt.tensors(), expected, strict=strict), context=context
    )
    return ckpt


def open_checkpoint(
    path: Path | RemotePath,
    model: ShardedModel,
    *,
    read: Callable[[Any], Any] | None,
    strict: bool,
    context: str,
    key: str | None,
    trusted: bool,
) -> dict[str, Any]:
    """A sharded directory's Lightning dict (its tensors still on disk) or a full file whose entry `key`
    (None: the file itself) is the model's state dict, checked on every rank before anything loads."""
    require_exists(model.world_comm, path, context=context)
    if not path.is_dir():
        return load_full(path, model, key=key, strict=strict, trusted=trusted, read=read)
    opened = open_checked(path, model, strict=strict, context=context, trusted=trusted)
    return run_and_agree(model.world_comm, opened.lightning_dict, context=context)  # type: ignore[no-any-return]


def load_model_state(model: ShardedModel, state_dict: Any, *, strict: bool) -> None:
    """A Lightning dict's "state_dict" into the shards: a sharded one's (each rank reads its chunks) or a whole one."""
    if isinstance(state_dict, ShardedStateDict):
        load_sharded_model(state_dict.checkpoint, model)
    else:
        model.load_full_state_dict(dict(state_dict), strict=strict)


def load_optimizer_states(model: ShardedModel, states: list[Any], optimizers: list[torch.optim.Optimizer]) -> None:
    """A Lightning dict's "optimizer_states" into `optimizers`, in the order saved."""
    if isinstance(states, ShardedOptimizerStates):
        load_sharded_optimizers(states.checkpoint, model, optimizers)
        return
    if len(states) != len(optimizers):
        raise CheckpointError(
            f"The checkpoint has state for {len(states)} optimizers but `configure_optimizers` returned "
            f"{len(optimizers)}; resume with the same optimizers."
        )
    for optimizer, state in zip(optimizers, states):
        load_full_optimizer_state(model, optimizer, state)


def load_sharded_model(ckpt: ShardedCheckpoint, model: ShardedModel) -> None:
    """Load the module's state dict from `ckpt` in place (collective: after `open_checked`); each
    rank reads only the chunks that overlap its new shards. Tensors the checkpoint lacks (allowed
    by strict=False) keep their values."""
    loads = _Loads(model, ckpt)
    sharded = sharded_by_name(model)
    with torch.no_grad():
        for sp in model.sharded_params:
            key = ckpt.stored_key(sp.names)
            if key is not None:
                loads.into_shard(f"state_dict/{key}", ckpt.kind(key), sp, sp.param.data)
        for key, value in model.module.state_dict().items():
            if key not in sharded and isinstance(value, torch.Tensor) and ckpt.kind(key) in ("tensor", "sharded"):
                loads.into_whole(f"state_dict/{key}", ckpt.kind(key), value)  # a view of the module's tensor
        loads.run()
        objects = [e["key"] for e in ckpt.meta["state_dict"] if e["kind"] == "object"]
        if objects:
            saved = ckpt.trainer_state()["state_dict"]
            model.module.load_state_dict({k: saved[k] for k in objects}, strict=False)


class _Loads:
    """The tensors one DCP load fills, and the copies to make after it when a parameter sharded in
    this run was whole in the saved one (a different persistence_threshold)."""

    def __init__(self, model: ShardedModel, ckpt: ShardedCheckpoint) -> None:
        self.model, self.ckpt, self.pieces = model, ckpt, Pieces(model)
        self.targets: dict[str, torch.Tensor] = {}
        self.after: list[Callable[[], object]] = []

    def into_shard(self, key: str, kind: str | None, sp: ShardedParam, shard: torch.Tensor) -> None:
        """Fill this rank's `shard` (padded, 1-D) of parameter `sp` from `key`."""
        if kind == "sharded":
            self.targets[key] = self.pieces.sharded(shard[: sp.valid_numel()], sp.numel)
            return
        whole = self.targets[key] = torch.empty(sp.whole_shape, dtype=shard.dtype)
        start, valid = sp.rank * sp.shard_numel, sp.valid_numel()
        self.after.append(lambda: shard[:valid].copy_(whole.reshape(-1)[start : start + valid]))

    def into_whole(self, key: str, kind: str | None, tensor: torch.Tensor) -> None:
        """Fill a tensor every rank holds whole (a buffer, a persistent parameter)."""
        self.targets[key] = tensor.reshape(-1) if kind == "sharded" else tensor

    def run(self) -> None:
        self.ckpt.reader.load(self.targets, self.model.world_comm)
        for copy in self.after:
            copy()
        note_shard_writes()  # engine/shard.py, Note: shard writes


def load_sharded_optimizers(
    ckpt: ShardedCheckpoint, model: ShardedModel, optimizers: list[torch.optim.Optimizer]
) -> None:
    """Load optimizer state from `ckpt`, each rank its slice for this run's world size; parameters
    are matched by name (the same param groups as saved)."""
    by_name = sharded_by_name(model)
    whole_params = dict(model.module.named_parameters(remove_duplicate=False))

    def plan() -> tuple[_Loads, list[dict[str, Any]]]:
        saved_meta = ckpt.meta["optimizers"]
        if saved_meta is None:
            raise CheckpointError(f"checkpoint {ckpt.path} was saved with weights only: it has no optimizer state")
        saved_objects = ckpt.trainer_state()["optimizers"]
        if len(saved_meta) != len(optimizers):
            raise CheckpointError(
                f"checkpoint {ckpt.path} has state for {len(saved_meta)} optimizers but this run configured "
                f"{len(optimizers)}"
            )
        loads = _Loads(model, ckpt)
        packed_all = []
        for index, (optimizer, meta, objs) in enumerate(zip(optimizers, saved_meta, saved_objects)):
            groups = optimizer_param_names(model, optimizer)
            _check_groups(ckpt.path, index, [g["params"] for g in objs["param_groups"]], groups)

            def tensor(name: str, k: str, info: dict[str, Any], index: int = index) -> torch.Tensor:
                key, dtype, sp = f"optimizer_states/{index}/{name}/{k}", dtype_of(info["dtype"]), by_name.get(name)
                # Shard-shaped in this run: saved sharded, or saved whole with the parameter's shape.
                if sp is not None and (info["kind"] == "sharded" or tuple(info["shape"]) == tuple(sp.whole_shape)):
                    value = torch.zeros(sp.shard_numel, dtype=dtype, device=sp.param.device)
                    loads.into_shard(key, info["kind"], sp, value)
                elif info["kind"] == "sharded":  # a parameter this run keeps whole
                    value = torch.empty(whole_params[name].shape, dtype=dtype)
                    loads.into_whole(key, "sharded", value)
                else:
                    value = torch.empty(info["shape"], dtype=dtype)
                    loads.into_whole(key, "tensor", value)
                return value

            packed_all.append(numbered_optimizer_state(meta, objs, groups, tensor))
        return loads, packed_all

    loads, packed_all = run_and_agree(model.world_comm, plan, context=f"Cannot load the optimizer state of {ckpt.path}")
    loads.run()
    for optimizer, packed in zip(optimizers, packed_all):
        optimizer.load_state_dict(packed)


def _check_groups(path: Path | RemotePath, index: int, saved: list[list[str]], current: list[list[str]]) -> None:
    if len(saved) != len(current):
        raise CheckpointError(
            f"checkpoint {path}: optimizer {index} had {len(saved)} param groups, this run's has {len(current)}"
        )
    for g, (old, new) in enumerate(zip(saved, current)):
        if set(old) != set(new):
            gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
            raise CheckpointError(
                f"checkpoint {path}: param group {g} of optimizer {index} differs: only in the checkpoint "
                f"{few(gone)}; only in this run {few(added)}"
            )


def load_sharded(
    path: str | os.PathLike,
    model: ShardedModel,
    *,
    optimizers: list[torch.optim.Optimizer] | tuple = (),
    strict: bool = True,
    verify: bool = True,
    trusted: bool = False,
) -> dict[str, Any]:
    """Check and load a sharded checkpoint into `model` (and `optimizers`) on every rank; the other
    entries of the checkpoint dict it was saved from. `trusted`: unpickle without restriction."""
    context = f"Cannot load the checkpoint {path}"
    ckpt = open_checked(path, model, strict=strict, context=context, trusted=trusted, verify=verify)
    load_sharded_model(ckpt, model)
    if optimizers:
        load_sharded_optimizers(ckpt, model, list(optimizers))
    return dict(ckpt.trainer_state()["extra"])
