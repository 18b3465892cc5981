"""`fabric.save` and `fabric.load` under `ZeRO3FabricStrategy`, on top of the run (common/run.py).
One model (with any number of its optimizers) per checkpoint, as Lightning's FSDP requires.
- "sharded": stored as a Trainer's sharded checkpoint ("state_dict", "optimizer_states"; docs/
  checkpoints.md), plus the entry "fabric": the user's keys for them and the rest of the state.
  So `python -m lightning_zero3 consolidate` reads it, and a Trainer's loads into Fabric.
- "full": one `torch.save` file from rank 0, the user's keys with whole tensors, as under DDP.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_zero3.checkpoint import CheckpointError, ShardedStateDict, as_path
from lightning_zero3.common.run import ReadFile, ShardedRun, WriteFile

OWNER = "ZeRO3FabricStrategy"  # the class these functions serve, named in their messages

FABRIC_KEY = "fabric"  # in a sharded checkpoint: {"module": key, "optimizers": [keys], "metadata": {...}}


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _split(
    run_of: Callable[[nn.Module], ShardedRun], state: dict[str, Any], verb: str
) -> tuple[str, ShardedRun, list[tuple[str, Optimizer]], dict[str, Any]]:
    """(the model's key, its run, (key, optimizer) pairs, every other entry)."""
    modules = [key for key, obj in state.items() if isinstance(obj, nn.Module)]
    if len(modules) != 1:
        raise ValueError(
            f"`fabric.{verb}` with {OWNER} needs exactly one model in the state, e.g. "
            f"{{'model': model, 'optimizer': optimizer}}; got {len(modules)} ({modules}). To {verb} several models, "
            f"call `fabric.{verb}` once per model with its own path."
        )
    module_key = modules[0]
    run = run_of(state[module_key])
    optimizers = [(key, obj) for key, obj in state.items() if isinstance(obj, Optimizer)]
    mine = {id(p) for p in run.engine.module.parameters()}
    for key, optimizer in optimizers:
        if not all(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                f"`fabric.{verb}`: the optimizer '{key}' holds parameters that are not those of the model "
                f"'{module_key}'. Put each model with its own optimizers in its own checkpoint."
            )
    rest = {key: obj for key, obj in state.items() if key != module_key and not isinstance(obj, Optimizer)}
    return module_key, run, optimizers, rest


def save(
    run_of: Callable[[nn.Module], ShardedRun],
    path: str | os.PathLike,
    state: dict[str, Any],
    write_file: WriteFile | None,
    *,
    filter: dict[str, Callable[[str, Any], bool]] | None = None,
) -> None:
    module_key, run, optimizers, rest = _split(run_of, state, "save")
    if run.sharded_checkpoints:
        if filter:
            raise ValueError(
                f"`fabric.save(..., filter=...)` needs {OWNER}(state_dict_type='full'): a sharded checkpoint stores "
                f"the whole model state, so that it loads at any number of ranks."
            )
        metadata = {key: obj.state_dict() if _stateful(obj) else obj for key, obj in rest.items()}
        checkpoint = {
            "state_dict": run.model_state_dict(),  # this rank's shards
            "optimizer_states": [run.optimizer_state(optimizer) for _, optimizer in optimizers],
            FABRIC_KEY: {"module": module_key, "optimizers": [key for key, _ in optimizers], "metadata": metadata},
        }
    else:
        checkpoint, filter = {}, filter or {}
        for key, obj in state.items():
            if key == module_key:
                value: Any = run.model_state_dict()
            elif isinstance(obj, Optimizer):
                value = run.optimizer_state(obj)
            else:
                value = obj.state_dict() if _stateful(obj) else obj
            if key in filter and isinstance(value, dict):
                value = {k: v for k, v in value.items() if filter[key](k, v)}
            checkpoint[key] = value
    run.save(path, checkpoint, write_file)


def load(
    run_of: Callable[[nn.Module], ShardedRun],
    filepath: str | os.PathLike,
    state: nn.Module | Optimizer | dict[str, Any] | None,
    read_file: ReadFile | None,
    *,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    file = as_path(filepath)
    context = f"Cannot load the checkpoint {file}"
    if isinstance(state, Optimizer):
        raise NotImplementedError(
            f"{OWNER} cannot load an optimizer alone: its state is keyed by the model's parameter "
            f"names. Use `fabric.load(path, {{'model': model, 'optimizer': optimizer}})`."
        )
    if isinstance(state, nn.Module):  # `fabric.load_raw(path, model)`: a plain state dict, or a sharded directory
        run = run_of(state)
        opened = run.open(file, read_file, weights_only=weights_only, strict=strict, context=context, key=None)
        run.load_model_state(
            opened["state_dict"] if isinstance(opened.get("state_dict"), ShardedStateDict) else opened, strict=strict
        )
        return {}
    if not state:
        raise ValueError(
            f"`fabric.load(path)` with {OWNER} needs the objects to load into, e.g. "
            f"`fabric.load(path, {{'model': model, 'optimizer': optimizer}})`: the model's shards are loaded in place."
        )
    module_key, run, optimizers, rest = _split(run_of, state, "load")
    # Every check runs before anything is loaded: a refused load leaves the model and optimizers as they were.
    opened = run.open(file, read_file, weights_only=weights_only, strict=strict, context=context, key=module_key)
    if isinstance(opened.get("state_dict"), ShardedStateDict):  # a Trainer's has no "fabric" entry: optimizers in order
        model_state, states = opened.pop("state_dict"), opened.pop("optimizer_states", None)
        info = opened.pop(FABRIC_KEY, None) or {"optimizers": [key for key, _ in optimizers], "metadata": opened}
        by_key = dict(optimizers)
        if optimizers and set(by_key) != set(info["optimizers"]):
            raise CheckpointError(
                f"{context}: it holds the optimizers {info['optimizers']} but the state passed to `fabric.load` "
                f"has {sorted(by_key)}; pass all of them (or none)."
            )
        if optimizers and states is None:
            raise CheckpointError(
                f"Cannot load the optimizer state of {file}: checkpoint {file} was saved with "
                "weights only: it has no optimizer state"
            )
        metadata, into = dict(info["metadata"]), [by_key[key] for key in info["optimizers"]] if optimizers else []
    else:
        absent = [key for key, _ in optimizers if key not in opened]
        if strict and absent:
            raise KeyError(f"{context}: it has no entry {absent}. Pass strict=False to load without it.")
        model_state, into = opened.pop(module_key), [optimizer for key, optimizer in optimizers if key in opened]
        states, metadata = [opened.pop(key) for key, _ in optimizers if key in opened], opened
    _check_holds(rest, metadata, strict=strict, context=context)
    run.load_model_state(model_state, strict=strict)
    run.load_optimizer_states(states if into else [], into)
    for key, obj in rest.items():
        if key in metadata and _stateful(obj):
            obj.load_state_dict(metadata.pop(key))
        elif key in metadata:
            state[key] = metadata.pop(key)
    return metadata


def _check_holds(rest: dict[str, Any], metadata: dict[str, Any], *, strict: bool, context: str) -> None:
    missing = [key for key in rest if key not in metadata]
    if strict and missing:
        raise KeyError(
            f"{context}: the state asks for {missing}, which the checkpoint does not hold. Pass strict=False to "
            f"load the rest."
        )
