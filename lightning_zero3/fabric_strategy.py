"""`ZeRO3FabricStrategy`: ZeRO-3 for Lightning Fabric, the same engine as the Trainer's
`ZeRO3Strategy` behind Fabric's strategy interface. As in Lightning (two `FSDPStrategy`
classes), Fabric refuses the Trainer's class; the name "zero3" works in both.

[Note: optimizers created before setup]
An optimizer built before `fabric.setup` holds the old whole parameters: without state yet it is
pointed at the shards by name, with state it is refused (docs/design.md, optimizers created
before setup).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero3 import fabric_checkpoint
from lightning_zero3.common.base import ShardedStrategy, all_reduce, checkpoint_io_files
from lightning_zero3.common.options import StartMethod, StateDictType, build_engine, split_options
from lightning_zero3.common.run import Fixes, ShardedRun
from lightning_zero3.engine import (
    AgreeingGradScaler,
    check_optimizer_fits_shards,
    clip_grad_norm_,
    parameters_on_meta,
    step_whole_matrices,
)
from lightning_zero3.tools.grads import sharded_grad_norm
from lightning_zero3.tools.summary import step_metrics

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler


class ZeRO3FabricStrategy(ShardedStrategy, ParallelStrategy):
    """ZeRO stage 3 for Lightning Fabric: parameters, gradients and optimizer state 1/N per rank.

    Takes the options of the Trainer's `ZeRO3Strategy` (its docstring, the README), read back as
    `strategy.config` and `strategy.lightning_options`, except `accumulate_unsharded`: Fabric's
    `no_backward_sync` does that. With start_method "spawn"/"fork"/
    "forkserver", ranks are started by `fabric.launch(function)`.
    """

    strategy_name = "zero3"
    description = "ZeRO stage 3 for Fabric (lightning_zero3)"
    which = "a Fabric strategy: for the Trainer use ZeRO3Strategy"
    _launchers = (_SubprocessScriptLauncher, _MultiProcessingLauncher)  # ShardedStrategy._configure_launcher

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        # The options: the engine's (ShardingConfig), then the Lightning-only ones (LightningOptions),
        # with their fields' types and defaults (tests/lightning/test_cli.py holds them to it).
        wrap_policy: set[type[nn.Module]] | Callable[[nn.Module], bool] | None = None,
        prefetch: int = 1,
        persistence_threshold: int = 0,
        shard_size: int | None = None,
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        reductions_in_flight: int | None = None,
        rank_checks: Literal["every_step", "first_step"] | int = "every_step",
        reshard_after_forward: bool | int = True,
        offload: Literal["host"] | None = None,
        offload_dir: str | None = None,
        quantize_weights: bool = False,
        quantize_gradients: bool | Literal["int8", "int4"] = False,
        quantize_block: int = 256,
        state_dict_type: StateDictType = "sharded",
        trust_checkpoint: bool = False,
        timeout: timedelta = timedelta(minutes=30),
        start_method: StartMethod = "popen",
        async_save: bool = False,
        accumulate_unsharded: bool = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self.config, self.lightning_options = split_options(type(self).__name__, locals())
        if accumulate_unsharded:  # the Trainer's accumulate_grad_batches, which Fabric has not
            raise ValueError(
                f"{type(self).__name__}(accumulate_unsharded=True) is for the Trainer's `accumulate_grad_batches`, "
                f"which Fabric does not have. Run the backwards of the micro-batches before the last inside "
                f"`with fabric.no_backward_sync(model):` (the same local sums, one Reduce-Scatter per step) and "
                f"leave the option out."
            )
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._runs: dict[int, ShardedRun] = {}  # one per module set up (a GAN has two), by id
        # id(whole parameter replaced by a shard) -> (a weak reference to it, its shard) (Note:
        # optimizers created before setup); the weak reference tells a reused id apart.
        self._replaced: dict[int, tuple[weakref.ref[Tensor], nn.Parameter]] = {}
        self._backward_sync_control = _NoBackwardSync(self._run_of)  # fabric.no_backward_sync

    # ---- what Fabric asks of a distributed strategy (and ShardedStrategy, common/base.py) -----
    # ---- building and sharding the model ----------------------------------------------------
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        # empty_init: parameters on the meta device, buffers real (Note: only parameters on meta),
        # materialised one module at a time by setup_module (engine/materialize.py); otherwise in
        # host memory, as under Lightning's FSDP. As the Trainer's strategy (strategy.py).
        stack = ExitStack()
        if empty_init:
            stack.enter_context(parameters_on_meta(self.root_device))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        # Nothing before `setup_module` (Fabric calls this first), which places each module's
        # shards on the device one at a time (engine/materialize.py, Note: sharding from host memory).
        for run in self._runs.values():
            if run.engine.module is module:
                run.engine.move_module(self.root_device)  # offloaded shards stay on the host

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard `module` in place (its parameters become this rank's 1-D shards) and return it."""
        if id(module) in self._runs:
            raise ValueError(f"{type(self).__name__}: this module was set up already; set up each module once.")
        before = {name: p for name, p in module.named_parameters(remove_duplicate=False)}
        sharded = build_engine(
            type(self).__name__,
            module,
            self.config,
            precision=self.precision,
            world_size=self.world_size,
            device=self.root_device,
            timeout=self.lightning_options.timeout,
        )
        self._runs[id(module)] = ShardedRun(sharded, lambda: self.lightning_options, fixes=_FIXES)
        sharded.move_module(self.root_device)  # what sharding did not place (e.g. torchmetrics states)
        after = dict(module.named_parameters(remove_duplicate=False))
        for name, old in before.items():
            if after[name] is not old:  # parameters kept whole (persistence_threshold) stay as they are
                self._replaced[id(old)] = (weakref.ref(old), after[name])
        plugin = self.precision
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:  # every rank skips the same steps
            plugin.scaler = AgreeingGradScaler.like(plugin.scaler, sharded, device=self.root_device.type)
        return module

    # Lightning's base annotates the deprecated `_LRScheduler`, which e.g. LambdaLR is not; any LRScheduler works.
    @override
    def setup_module_and_optimizers(  # type: ignore[override]
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: LRScheduler | None = None
    ) -> tuple[nn.Module, list[Optimizer], LRScheduler | None]:
        # Checked before sharding, so that a mistake leaves the model untouched.
        owner, names = type(self).__name__, {id(p): name for name, p in module.named_parameters()}
        mine = set(names)
        _check_no_state(optimizers, owner)
        for optimizer in optimizers:
            check_optimizer_fits_shards(optimizer, owner, warn=False, names=names)  # warned in setup_optimizer
            _refuse_foreign(
                optimizer,
                mine,
                owner,
                "that are not the model's",
                "Build it from `model.parameters()` of the model passed to `fabric.setup`.",
            )
        module = self.setup_module(module)  # the optimizers are pointed at the shards next
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that `optimizer` holds shards; one built before `setup_module` is pointed at them."""
        check_optimizer_fits_shards(optimizer, type(self).__name__)
        if any(self._shard_of(p) is not None for group in optimizer.param_groups for p in group["params"]):
            _check_no_state([optimizer], type(self).__name__)
            for group in optimizer.param_groups:
                group["params"] = [shard if (shard := self._shard_of(p)) is not None else p for p in group["params"]]
        known = {id(p) for run in self._runs.values() for p in run.engine.module.parameters()}
        _refuse_foreign(
            optimizer,
            known,
            type(self).__name__,
            "of no model set up with Fabric",
            "Call `model = fabric.setup_module(model)` first, then build the optimizer from `model.parameters()` and "
            "call `fabric.setup_optimizers(optimizer)`; or pass both to `fabric.setup(model, optimizer)`.",
        )
        if any(group["params"] for group in optimizer.param_groups):  # torch.optim.Muon's steps
            step_whole_matrices(self._run_of_optimizer(optimizer).engine, optimizer, type(self).__name__)
        return optimizer

    def _shard_of(self, param: Tensor) -> nn.Parameter | None:
        """The shard that replaced `param` in `setup_module`, or None if `param` was not replaced."""
        entry = self._replaced.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def _run_of(self, module: nn.Module | None = None, *, within: bool = False) -> ShardedRun:
        """`sharded_model`'s run; `within`: `module` may also be a submodule of a model set up."""
        if module is None and len(self._runs) == 1:
            return next(iter(self._runs.values()))
        inner = getattr(module, "_forward_module", module)  # Fabric's wrapper around what setup returned
        for run in self._runs.values():
            wrapped = run.engine.module
            if wrapped is module or wrapped is inner or (within and any(m is inner for m in wrapped.modules())):
                return run
        raise ValueError(
            f"{type(self).__name__}: {type(module).__name__ if module is not None else 'no module'} was not set up "
            f"with this strategy ({len(self._runs)} set up). Pass the model returned by `fabric.setup(...)`."
        )

    def _run_of_optimizer(self, optimizer: Optimizer) -> ShardedRun:
        first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        for run in self._runs.values():
            if any(p is first for p in run.engine.module.parameters()):
                return run
        raise ValueError(f"{type(self).__name__}: the optimizer holds no parameter of a model set up with Fabric.")

    # ---- a training step ------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, Optimizer):
            self._run_of_optimizer(inner).engine.stats.end_step()  # close the step's traffic accounting
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm of the whole gradient: one All-Reduce over the shards' norms.
        `error_if_nonfinite=True` (Fabric's default) reads the norm on the host to raise here, as
        torch's `clip_grad_norm_` does, a sync per step on a GPU; False clips without any read."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        model = self.sharded_model(module)
        return clip_grad_norm_(model, params, float(max_norm), float(norm_type), error_if_nonfinite=error_if_nonfinite)

    def grad_norm(self, module: nn.Module, norm_type: float | int | str = 2.0) -> dict[str, Tensor]:
        """Lightning's `grad_norm(module, norm_type)` for a sharded model: per parameter and total
        norms of the whole gradient, the same on every rank (one All-Reduce)."""
        sharded = self.sharded_model(module)
        return sharded_grad_norm(sharded, sharded.module, norm_type)

    def step_metrics(self, module: nn.Module | None = None, prefix: str = "zero3/") -> dict[str, float]:
        """What the last optimizer step of `module` (default: the only model) moved, waited for and
        the memory it used, as flat numbers for `fabric.log_dict(fabric.strategy.step_metrics(model))` after
        `optimizer.step()` (tools/summary.py `step_metrics`, the Trainer's `ShardingStatsMonitor`)."""
        return step_metrics(self.sharded_model(module).stats.report([]), self.root_device, prefix)

    # ---- collectives Fabric uses -----------------------------------------------------------
    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return all_reduce(type(self).__name__, tensor, group, reduce_op)

    # ---- checkpoints (lightning_zero3/fabric_checkpoint.py) ------------------------------------
    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """`fabric.save`: "sharded" writes a directory (each rank its shards, nothing gathered),
        "full" one ordinary file from rank 0 with whole tensors. Both load at any world size."""
        if storage_options is not None:
            raise TypeError(f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported.")
        write = checkpoint_io_files(self.checkpoint_io).write
        file = self.broadcast_checkpoint_path(path, saving=True)
        fabric_checkpoint.save(self._run_of, file, state, write, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """`fabric.load`: a sharded directory or a full file, saved at any world size."""
        read = checkpoint_io_files(self.checkpoint_io, weights_only=weights_only).read
        file = self.broadcast_checkpoint_path(path, saving=False)  # a path or a URL (Note: remote checkpoints)
        return fabric_checkpoint.load(self._run_of, file, state, read, strict=strict, weights_only=weights_only)

    # ---- teardown ---------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        # Fabric tells a strategy nothing of failures, so no collective: each module is left
        # sharded (common/run.py, Note: run lifecycle), the last background save's error raised here.
        errors = [run.wait_for_save(agree=False) for run in self._runs.values()]
        for run in self._runs.values():
            run.end(failed=True)
        self._runs.clear()
        self._replaced.clear()  # the whole parameters' entries would keep every old shard alive
        super().teardown()
        for error in errors:
            if error is not None:
                raise error


_FIXES = Fixes(  # named where a module's own (load_)state_dict() meets shards (common/run.py)
    read="For whole weights, read them inside `with fabric.strategy.gathered_parameters(model):` on every rank (there "
    "`state_dict()` of the model and of any submodule is whole), or save with `fabric.save(path, {'model': model})` "
    "(with `ZeRO3FabricStrategy(state_dict_type='full')`: one ordinary file of whole tensors).",
    load="To load whole weights, call `model.load_state_dict(state_dict)` inside `with fabric.strategy."
    "gathered_parameters(model, modifier_rank=0):` on every rank (rank 0's load is kept), or use "
    "`fabric.load_raw(path, model)` or `fabric.load(path, {'model': model})` on every rank, or load before "
    "`fabric.setup`.",
)


class _NoBackwardSync(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: backwards inside sum the unsharded gradients locally and
    the first outside Reduce-Scatters once (`ShardedModel.no_sync`, engine/accumulate.py)."""

    def __init__(self, run_of: Callable[[nn.Module], ShardedRun]) -> None:
        self.run_of = run_of

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.run_of(module).engine.no_sync() if enabled else nullcontext()


def _check_no_state(optimizers: list[Optimizer], owner: str) -> None:
    for optimizer in optimizers:
        if optimizer.state:
            raise ValueError(
                f"{owner}: the optimizer {type(optimizer).__name__} has state (it has already stepped, or its "
                f"constructor made it, as Adagrad's does) in the whole parameters' shapes, not the shards'. Build "
                f"the optimizer after `fabric.setup_module(model)` "
                f"(or pass a fresh one to `fabric.setup(model, optimizer)`), and load saved state with `fabric.load`."
            )


def _refuse_foreign(optimizer: Optimizer, known: set[int], owner: str, whose: str, fix: str) -> None:
    """Raise if `optimizer` holds a parameter whose id is not in `known`, naming the first shapes."""
    foreign = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"] if id(p) not in known]
    if foreign:
        raise ValueError(
            f"{owner}: the optimizer {type(optimizer).__name__} holds parameters {whose} (shapes {foreign[:4]}). {fix}"
        )


__all__ = ["ZeRO3FabricStrategy"]
