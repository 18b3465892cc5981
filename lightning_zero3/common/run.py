"""`ShardedRun`: one module under ZeRO-3 from a strategy's setup to its teardown, what the
Trainer's `ZeRO3Strategy` and Fabric's `ZeRO3FabricStrategy` share. It knows nothing of Lightning:
the strategies are thin glue that hand it the engine, their options and the file functions of
their checkpoint plugin.

[Note: run lifecycle]
SHARDED -> AT_REST after `fit` (shards and hooks stay, as FSDP and DeepSpeed leave theirs), back
to SHARDED on the next setup by the same strategy; SHARDED -> LEFT_SHARDED after a failure, with no
collective, because other ranks may be gone (docs/design.md, run lifecycle).

[Note: a module's own state_dict]
A module's own `state_dict()`/`load_state_dict()` never meets a shard by surprise: whole inside
`gathered_parameters`, refused elsewhere, since whole tensors there need a collective that a
rank-0-only call would hang (docs/design.md, a module's own state_dict).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from enum import Enum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero3.checkpoint import (
    BackgroundSave,
    CheckpointError,
    RemotePath,
    as_path,
    load_model_state,
    load_optimizer_states,
    open_checkpoint,
    save_full,
    save_in_background,
    save_sharded,
    saver_comm,
    sharded_optimizer_state,
)
from lightning_zero3.checkpoint import agree as agree_on_error
from lightning_zero3.checkpoint import remove_checkpoint as remove_checkpoint_path
from lightning_zero3.engine import (
    Comm,
    ShardedModel,
    ShardedParam,
    destroy_group,
    forget,
    full_optimizer_state,
    holder,
    remember_sharded,
)

if TYPE_CHECKING:
    from lightning_zero3.common.options import LightningOptions

# How a strategy's checkpoint plugin writes, reads and removes one full-checkpoint file; None: the package's
# own atomic writer, memory-mapped reader and remover (checkpoint/full.py).
WriteFile = Callable[[dict[str, Any], Any], None]  # (checkpoint, a Path or a URL string)
ReadFile = Callable[[Any], Any]
RemoveFile = Callable[[Any], None]


log = logging.getLogger(__name__)

# What a user does with a module its run left sharded (Note: run lifecycle).
LEFT_SHARDED_FIX = (
    "(The run failed, or Fabric's strategy was torn down.) Fit, validate, test or predict with it again on every rank, "
    "or set it up again with `fabric.setup` (the new run makes it whole first), or build a new module and load a "
    "checkpoint into it."
)


class Lifecycle(Enum):
    """Where a run's module stands (Note: run lifecycle)."""

    SHARDED = "sharded"
    AT_REST = "at rest"
    LEFT_SHARDED = "left sharded"


class Fixes(NamedTuple):
    """How a strategy's user reads and loads whole weights, named in the guard's messages."""

    read: str
    load: str


_ANY_STRATEGY = Fixes(
    read="For whole weights, read inside `strategy.gathered_parameters(model)` on every rank, or save a checkpoint.",
    load="To load whole weights, call it inside `strategy.gathered_parameters(model, modifier_rank=0)` on every rank.",
)


class _ShardGuard:
    """The state_dict and load_state_dict pre-hooks on every module that owns a shard (Note: a
    module's own state_dict). Referenced by the hooks, it keeps the run, so the engine lives as long as
    the module; `remove()` (by `forget`, engine/left_sharded.py) takes the hooks off."""

    def __init__(self, run: ShardedRun, fixes: Fixes) -> None:
        self.run = run
        self.fixes = fixes
        owned: dict[nn.Module, list[tuple[str, ShardedParam]]] = {}
        for sharded in run.engine.sharded_params:
            for module, attr in sharded.owners:
                owned.setdefault(module, []).append((attr, sharded))
        self.handles = [
            handle
            for module, params in owned.items()
            for handle in (
                module.register_state_dict_pre_hook(partial(self.before_save, params)),
                module.register_load_state_dict_pre_hook(partial(self.before_load, params)),
            )
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    @staticmethod
    def _shards(module: nn.Module, params: list[tuple[str, ShardedParam]]) -> list[tuple[str, ShardedParam]]:
        """The parameters the module still holds as shards (a module made whole holds others).
        Its registered ones, what `state_dict()` reads: during forward whole tensors shadow them."""
        registered = dict(module.named_parameters(recurse=False, remove_duplicate=False))
        return [(attr, sharded) for attr, sharded in params if registered.get(attr) is sharded.param]

    def _refusal(self, call: str, key: str, sharded: ShardedParam, fix: str) -> RuntimeError:
        if self.run.state is Lifecycle.LEFT_SHARDED:  # no gather any more: set up again
            return RuntimeError(
                f"{call}: '{key}' is this rank's 1-D shard of a {tuple(sharded.whole_shape)} parameter, and the run "
                f"that sharded it ended without making it whole. {LEFT_SHARDED_FIX}"
            )
        return RuntimeError(
            f"{call}: '{key}' is this rank's 1-D shard ({sharded.shard_numel} of the {sharded.numel} elements of a "
            f"{tuple(sharded.whole_shape)} parameter): under ZeRO-3 the parameters are 1-D shards outside forward and "
            f"outside `gathered_parameters`, during and after `fit`. {fix}"
        )

    def before_save(
        self, params: list[tuple[str, ShardedParam]], module: nn.Module, prefix: str, keep_vars: bool
    ) -> None:
        if self.run.engine.reading_own:
            return
        for attr, sharded in self._shards(module, params):
            if not sharded.gathered:
                raise self._refusal("state_dict()", prefix + attr, sharded, self.fixes.read)

    def before_load(
        self,
        params: list[tuple[str, ShardedParam]],
        module: nn.Module,
        state_dict: Mapping[str, Any],
        prefix: str,
        *args: Any,
    ) -> None:
        if self.run.engine.reading_own:
            return
        for attr, sharded in self._shards(module, params):
            key = prefix + attr
            if key not in state_dict:
                continue
            if not sharded.gathered:  # each rank would load what its own call gives, into its shard
                raise self._refusal("load_state_dict()", key, sharded, self.fixes.load)
            if sharded.gathered[-1] is None:
                raise RuntimeError(
                    f"load_state_dict() inside `gathered_parameters` without `modifier_rank`: '{key}' goes back to its "
                    f"shard on exit, so the load would be dropped. {self.fixes.load}"
                )


class ShardedRun:
    """The engine for one module plus what both strategies do with it the same way."""

    def __init__(
        self, engine: ShardedModel, options: Callable[[], LightningOptions], *, fixes: Fixes = _ANY_STRATEGY
    ) -> None:
        self.engine = engine
        # The strategy's options, read at each save and load: `strategy.lightning_options =
        # replace(...)` after setup (e.g. a full save after a sharded one) reaches this run.
        self.options = options
        self.state = Lifecycle.SHARDED
        # The save writing in the background, if any, and the process group of such saves,
        # created at the first (Note: background saves in checkpoint/background.py).
        self.saving: BackgroundSave | None = None
        self._saver: Comm | None = None
        # The module's state_dict() on shards is refused but inside `engine.own_reads` (Note: a module's
        # own state_dict); the guard's hooks hold this run.
        self.fixes = fixes
        self.guard = _ShardGuard(self, fixes)

    def end(self, *, failed: bool) -> None:
        """The strategy's teardown (Note: run lifecycle)."""
        if self.state is not Lifecycle.SHARDED:
            return
        if failed:
            self.engine.leave_sharded(fix=LEFT_SHARDED_FIX)
        self.state = Lifecycle.LEFT_SHARDED if failed else Lifecycle.AT_REST
        remember_sharded(self.engine.module, self.engine, self.guard)  # whole again by a new engine; failed: no forward
        if not failed:
            self.engine.rest()  # the optimizer's state stays, for a save after `fit` or the next `fit`
        if self._saver is not None and self._saver is not self.engine.world_comm:
            destroy_group(self._saver.group)  # later saves of this run write synchronously
        self._saver = None

    @property
    def at_rest(self) -> bool:
        """At rest and still holding the module (no other engine has made it whole since)."""
        return self.state is Lifecycle.AT_REST and holder(self.engine.module) is self.engine

    def resume(self) -> None:
        """AT_REST -> SHARDED: the same strategy sets the same module up again (Note: run lifecycle)."""
        assert self.at_rest, f"ZeRO-3 internal error: resume from {self.state.name}"
        forget(self.engine.module)  # removes the guard's hooks
        self.guard = _ShardGuard(self, self.fixes)
        self.state = Lifecycle.SHARDED

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, Tensor]:
        """The module's whole state dict, gathered one unit at a time, in host memory: on rank 0
        only (others get {}) or on every rank. Collective: call it on every rank."""
        return self.engine.full_state_dict(to_rank=0 if rank0_only else None)

    # ---- checkpoints: "sharded" a directory of every rank's shards (nothing gathered), "full" one
    # file from rank 0. Loading takes either, at any world size; ranks agree that a checkpoint is
    # readable and fits the model before any collective loads it (checkpoint/errors.py, Note: no
    # hang on a bad checkpoint).
    @property
    def sharded_checkpoints(self) -> bool:
        return self.options().state_dict_type == "sharded"

    def model_state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores for the module: this rank's shards, or the whole state dict on
        rank 0 for a full checkpoint (collective)."""
        if self.sharded_checkpoints:
            with self.engine.own_reads():
                return self.engine.module.state_dict()
        return self.full_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        if self.sharded_checkpoints:
            return sharded_optimizer_state(self.engine, optimizer)
        return full_optimizer_state(self.engine, optimizer, to_rank=0)

    def save(self, path: str | os.PathLike, checkpoint: dict[str, Any], write_file: WriteFile | None) -> None:
        """Write `checkpoint` (built from `model_state_dict` and `optimizer_state`) at `path`,
        replacing what a save put there before, atomically. With `async_save`, a sharded save
        while the module is sharded returns once its snapshot is in host memory (Note: background
        saves)."""
        target = as_path(path)
        if self.engine.gradients_owed:
            warnings.warn(
                f"Saving {target} while gradients summed with sync off are owed (between the micro-batches of "
                "`no_backward_sync` / `no_sync`): the checkpoint holds the parameters and optimizer state from "
                "before them, not the partial sums, so a resume repeats those micro-batches. Save after the "
                "synced backward and the optimizer step.",
                stacklevel=3,
            )
        self.wait_for_save()
        if not self.sharded_checkpoints:
            save_full(checkpoint, target, self.engine.world_comm, write=write_file)
        elif self.options().async_save and self.state is Lifecycle.SHARDED:
            if self._saver is None:
                self._saver = saver_comm(self.engine.world_comm, self.options().timeout)
            self.saving = save_in_background(target, self.engine, checkpoint, self._saver)
        else:
            save_sharded(target, self.engine, checkpoint)

    def wait_for_save(self, *, agree: bool = True) -> CheckpointError | None:
        """Wait for the save writing in the background, if any. `agree` (collective): its error
        is raised on every rank; else (no collective: a teardown where other ranks may be gone)
        logged and returned."""
        saving, self.saving = self.saving, None
        if saving is None:
            return None
        error = saving.wait()
        context = f"Saving {saving.what} in the background failed (any previous checkpoint there is unchanged)"
        if agree:
            agree_on_error(self.engine.world_comm, error, context=context)
        elif error is not None:
            log.error(f"{context}: {error}")
            return CheckpointError(f"{context}: {error}")
        return None

    def open(
        self,
        path: Path | RemotePath,
        read_file: ReadFile | None,
        *,
        weights_only: bool | None,
        strict: bool,
        context: str,
        key: str | None,
    ) -> dict[str, Any]:
        """`open_checkpoint` once a background save is done; unpickled without restriction only when asked
        to: `trust_checkpoint` or `weights_only=False` (checkpoint/trust.py)."""
        self.wait_for_save()  # it may be writing this very path
        trusted = self.options().trust_checkpoint or weights_only is False
        with self.engine.own_reads():  # checked against the names and shapes of the module's state_dict()
            return open_checkpoint(
                path, self.engine, read=read_file, strict=strict, context=context, key=key, trusted=trusted
            )

    # ---- a Lightning checkpoint dict's entries, as the Trainer saves them (and Fabric's sharded saves)
    def load_model_state(self, state_dict: Mapping[str, Any], *, strict: bool) -> None:
        with self.engine.own_reads():  # it reads the module's state_dict()
            load_model_state(self.engine, state_dict, strict=strict)

    def load_optimizer_states(self, states: list[Any], optimizers: list[Optimizer]) -> None:
        load_optimizer_states(self.engine, states, optimizers)


def remove_checkpoint(
    path: str | os.PathLike, remove_file: RemoveFile | None, *, after: BackgroundSave | None = None
) -> None:
    """Rank 0 only, as Lightning calls it; no collective. After a save writing in the background
    (`after`), once it has succeeded (Note: background saves in checkpoint/background.py)."""
    if after is not None:
        after.then(lambda: remove_checkpoint(path, remove_file))
    elif remove_file is not None and not as_path(path).is_dir():
        remove_file(path)  # a full-checkpoint file in the plugin's format
    else:
        try:
            remove_checkpoint_path(path)  # a sharded directory, a file, or a link to either
        except CheckpointError as err:
            # A warning, not an exception, keeps the ranks in step; what is not a checkpoint stays
            # (Note: what a save may replace).
            log.warning(str(err))


__all__ = ["Lifecycle", "ReadFile", "RemoveFile", "ShardedRun", "WriteFile", "remove_checkpoint"]
