"""`fabric.save` and `fabric.load` under `ZeRO3FabricStrategy`, on top of lightning_zero3/checkpoint/.

A Fabric state is a dict of the user's choosing: {"model": model, "optimizer": optimizer,
"step": 3, ...}. One model (with any number of its optimizers) per checkpoint, as Lightning's
FSDP strategy for Fabric requires.

- "sharded": the package's sharded directory (docs/checkpoints.md). The model's state dict and the
  optimizers' states are stored as a Trainer checkpoint stores them ("state_dict",
  "optimizer_states"); the entry "fabric" records which keys of the user's state they were and
  holds the rest of it. So `python -m lightning_zero3 consolidate` works on it too, and a
  Trainer's sharded checkpoint loads into a Fabric model.
- "full": one ordinary `torch.save` file from rank 0, the user's keys with whole tensors: the
  file a DDP run of the same script writes, and reads.
Both load at any world size; every rank agrees that a checkpoint is readable and fits the model
before any collective that loads it (checkpoint/errors.py, Note: no hang on a bad checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import TorchCheckpointIO
from torch import nn
from torch.optim import Optimizer

from lightning_zero3.checkpoint import CheckpointError, load_full, save_full, save_sharded, sharded_optimizer_state
from lightning_zero3.checkpoint.errors import require_exists, run_and_agree
from lightning_zero3.checkpoint.load import load_sharded_model, load_sharded_optimizers, open_checked
from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.state import full_optimizer_state, load_full_optimizer_state

if TYPE_CHECKING:
    from lightning_zero3.fabric_strategy import ZeRO3FabricStrategy

FABRIC_KEY = "fabric"  # in a sharded checkpoint: {"module": key, "optimizers": [keys], "metadata": {...}}


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _split(
    strategy: ZeRO3FabricStrategy, state: dict[str, Any], verb: str
) -> tuple[str, ShardedModel, list[tuple[str, Optimizer]], dict[str, Any]]:
    """(the model's key, its engine, (key, optimizer) pairs, every other entry)."""
    modules = [key for key, obj in state.items() if isinstance(obj, nn.Module)]
    if len(modules) != 1:
        raise ValueError(
            f"`fabric.{verb}` with {type(strategy).__name__} needs exactly one model in the state, e.g. "
            f"{{'model': model, 'optimizer': optimizer}}; got {len(modules)} ({modules}). To {verb} several models, "
            f"call `fabric.{verb}` once per model with its own path."
        )
    module_key = modules[0]
    model = strategy.sharded_model(state[module_key])
    optimizers = [(key, obj) for key, obj in state.items() if isinstance(obj, Optimizer)]
    mine = {id(p) for p in model.module.parameters()}
    for key, optimizer in optimizers:
        if not all(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                f"`fabric.{verb}`: the optimizer '{key}' holds parameters that are not those of the model "
                f"'{module_key}'. Put each model with its own optimizers in its own checkpoint."
            )
    rest = {key: obj for key, obj in state.items() if key != module_key and not isinstance(obj, Optimizer)}
    return module_key, model, optimizers, rest


def _filtered(key: str, value: Any, filter: dict[str, Callable[[str, Any], bool]]) -> Any:
    if key in filter and isinstance(value, dict):
        return {k: v for k, v in value.items() if filter[key](k, v)}
    return value


def save(
    strategy: ZeRO3FabricStrategy,
    path: str,
    state: dict[str, Any],
    *,
    filter: dict[str, Callable[[str, Any], bool]] | None = None,
) -> None:
    module_key, model, optimizers, rest = _split(strategy, state, "save")
    if strategy.state_dict_type == "sharded":
        if filter:
            raise ValueError(
                f"`fabric.save(..., filter=...)` needs {type(strategy).__name__}(state_dict_type='full'): a sharded "
                f"checkpoint stores the whole model state, so that it loads at any number of ranks."
            )
        metadata = {key: obj.state_dict() if _stateful(obj) else obj for key, obj in rest.items()}
        checkpoint = {
            "state_dict": model.module.state_dict(),  # this rank's shards
            "optimizer_states": [sharded_optimizer_state(model, optimizer) for _, optimizer in optimizers],
            FABRIC_KEY: {"module": module_key, "optimizers": [key for key, _ in optimizers], "metadata": metadata},
        }
        save_sharded(Path(path), model, checkpoint)
        return
    full: dict[str, Any] = {}
    for key, obj in state.items():
        if key == module_key:
            value: Any = model.full_state_dict(to_rank=0)
        elif isinstance(obj, Optimizer):
            value = full_optimizer_state(model, obj, to_rank=0)
        else:
            value = obj.state_dict() if _stateful(obj) else obj
        full[key] = _filtered(key, value, filter or {})

    write = None if type(strategy.checkpoint_io) is TorchCheckpointIO else strategy.checkpoint_io.save_checkpoint
    save_full(full, path, model.world_comm, write=write)


def load(
    strategy: ZeRO3FabricStrategy,
    path: str,
    state: nn.Module | Optimizer | dict[str, Any] | None,
    *,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    file = Path(path)
    context = f"Cannot load the checkpoint {file}"
    # Unpickle without restriction only when asked to (checkpoint/trust.py, Note: checkpoint trust model).
    trusted = strategy.options.trust_checkpoint or weights_only is False
    if isinstance(state, Optimizer):
        raise NotImplementedError(
            f"{type(strategy).__name__} cannot load an optimizer alone: its state is keyed by the model's parameter "
            f"names. Use `fabric.load(path, {{'model': model, 'optimizer': optimizer}})`."
        )
    if isinstance(state, nn.Module):  # `fabric.load_raw(path, model)`: a plain state dict, or a sharded directory
        model = strategy.sharded_model(state)
        require_exists(model.world_comm, file, context=context)
        if file.is_dir():
            _load_sharded_model(model, file, strict=strict, context=context, trusted=trusted)
        else:
            model.load_full_state_dict(load_full(file, model, key=None, strict=strict, trusted=trusted), strict=strict)
        return {}
    if not state:
        raise ValueError(
            f"`fabric.load(path)` with {type(strategy).__name__} needs the objects to load into, e.g. "
            f"`fabric.load(path, {{'model': model, 'optimizer': optimizer}})`: the model's shards are loaded in place."
        )
    module_key, model, optimizers, rest = _split(strategy, state, "load")
    require_exists(model.world_comm, file, context=context)
    if file.is_dir():
        ckpt = _load_sharded_model(model, file, strict=strict, context=context, trusted=trusted)
        saved = run_and_agree(model.world_comm, ckpt.trainer_state, context=context)
        extra = dict(saved["extra"])
        # A Trainer's checkpoint has no "fabric" entry: its optimizers are in order, the rest is metadata.
        info = extra.pop(FABRIC_KEY, None) or {"optimizers": [key for key, _ in optimizers], "metadata": extra}
        if optimizers:
            by_key = dict(optimizers)
            if set(by_key) != set(info["optimizers"]):
                raise CheckpointError(
                    f"{context}: it holds the optimizers {info['optimizers']} but the state passed to `fabric.load` "
                    f"has {sorted(by_key)}; pass all of them (or none)."
                )
            load_sharded_optimizers(ckpt, model, [by_key[key] for key in info["optimizers"]])
        metadata = dict(info["metadata"])
    else:
        checkpoint = load_full(file, model, key=module_key, strict=strict, trusted=trusted)
        model.load_full_state_dict(checkpoint.pop(module_key), strict=strict)
        for key, optimizer in optimizers:
            if key in checkpoint:
                load_full_optimizer_state(model, optimizer, checkpoint.pop(key))
            elif strict:
                raise KeyError(f"{context}: it has no entry '{key}'. Pass strict=False to load without it.")
        metadata = checkpoint
    missing = [key for key in rest if key not in metadata]
    if strict and missing:
        raise KeyError(
            f"{context}: the state asks for {missing}, which the checkpoint does not hold. Pass strict=False to "
            f"load the rest."
        )
    for key, obj in rest.items():
        if key not in metadata:
            continue
        if _stateful(obj):
            obj.load_state_dict(metadata.pop(key))
        else:
            state[key] = metadata.pop(key)
    return metadata


def _load_sharded_model(model: ShardedModel, path: Path, *, strict: bool, context: str, trusted: bool) -> Any:
    ckpt = open_checked(path, model, strict=strict, context=context, trusted=trusted)
    load_sharded_model(ckpt, model)
    return ckpt
