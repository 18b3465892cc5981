"""`ZeRO3Strategy`, the Trainer's glue around the engine: the setup order (shard on the device,
then build optimizers), the process group, clipping, checkpoints and `strategy.stats`. It never
calls a collective on parameter data itself: the engine does.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero3.checkpoint import as_path
from lightning_zero3.common.base import ShardedStrategy, all_reduce, checkpoint_io_files
from lightning_zero3.common.options import StartMethod, StateDictType, build_engine, split_options
from lightning_zero3.common.run import Fixes, Lifecycle, ShardedRun, remove_checkpoint
from lightning_zero3.engine import (
    check_optimizer_fits_shards,
    parameters_on_meta,
    shard_state_built_whole,
    step_whole_matrices,
    whole_shapes,
)
from lightning_zero3.precision import sharded_precision
from lightning_zero3.tools.callbacks import refuse_unsupported_callbacks
from lightning_zero3.tools.summary import count_full_parameters


class _RootCall(nn.Module):
    """A thin wrapper so that Lightning's forward redirection (`training_step` etc. routed
    through `wrapper(...)`) runs the LightningModule's forward hooks, which gather the root
    unit for the whole step."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class _WholeWeightsLauncher(_MultiProcessingLauncher):
    """The spawn launcher hands rank 0's `module.state_dict()` back to the main process: after
    `fit` every rank first gathers the whole weights to rank 0, which hands those back."""

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        strategy = self._strategy
        assert isinstance(strategy, ZeRO3Strategy)
        whole = strategy.full_state_dict() if trainer.state.fn == TrainerFn.FITTING else {}
        with strategy.sharded_model().own_reads():  # Lightning reads the module's state_dict() on every rank
            output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            strategy.checkpoint_io.save_checkpoint(whole, output.weights_path)  # over rank 0's shards
        return output


class ZeRO3Strategy(ShardedStrategy, ParallelStrategy):
    """ZeRO stage 3: parameters, gradients and optimizer state partitioned 1/N over ranks.

    Takes keyword options only: Lightning's own, then the engine's (`lightning_zero3.engine.ShardingConfig`)
    and the Lightning-only ones (`LightningOptions` in common/options.py), both in the README's table (LightningCLI's
    `init_args` take them). They are read back as `strategy.config` and `strategy.lightning_options`;
    `dataclasses.replace(strategy.config, prefetch=2)` validates again. A ``param_dtype`` of None
    follows the Trainer's precision ("bf16-mixed" -> bf16, "16-mixed" -> fp16).
    """

    strategy_name = "zero3"
    description, which = "ZeRO stage 3 (lightning_zero3)", "a Trainer strategy: for Fabric use ZeRO3FabricStrategy"
    _launchers = (_SubprocessScriptLauncher, _WholeWeightsLauncher)  # ShardedStrategy._configure_launcher

    def __init__(
        self,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
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
            precision_plugin=precision_plugin,
        )
        self.config, self.lightning_options = split_options(type(self).__name__, locals())
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        # The module under ZeRO-3 (common/run.py, Note: run lifecycle); None before the first setup.
        self.run: ShardedRun | None = None
        # Set by `on_exception`: teardown then makes no collective (other ranks may be gone).
        self._failed = False

    @override
    def __getstate__(self) -> dict[str, Any]:
        # The engine holds this process's process groups and hooks; a pickled strategy (as in
        # `torch.save(trainer)`) leaves it behind, like Lightning's DDP drops its process group.
        return {**super().__getstate__(), "run": None}

    # ---- what Lightning asks of a distributed strategy (and ShardedStrategy, common/base.py) --
    @property
    def is_distributed(self) -> bool:
        # Lightning knows only its own strategies as distributed: else no DistributedSampler, no `sync_dist`.
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the shards, after sharding and optimizer creation

    # ---- setup ------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        refuse_unsupported_callbacks(trainer.callbacks, type(self).__name__)  # tools/callbacks.py: why and what instead
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self._failed = False
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self._setup_model(self.model)  # shards on the device, from wherever the module is
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # As Lightning's strategies: the optimizer state next to its parameter (offloaded: in
            # host memory); "step" counters stay on the CPU, where torch keeps them.
            for optimizer in self.optimizers:
                for param, state in optimizer.state.items():
                    for key, value in state.items():
                        if key != "step" and isinstance(value, Tensor):
                            state[key] = value.to(param.device)
        self.setup_precision_plugin()
        count_full_parameters(trainer.callbacks, self.sharded_model().whole_numel)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        module = self.lightning_module
        assert module is not None
        if self.run is not None and self.run.engine.module is module and self.run.at_rest:
            self.run.resume()  # after `fit`: the same shards, no collective (common/run.py, Note: run lifecycle)
            engine = self.run.engine
        else:
            engine = build_engine(
                type(self).__name__,
                module,
                self.config,
                precision=self.precision_plugin,
                world_size=self.world_size,
                device=self.root_device,
                timeout=self.lightning_options.timeout,
            )
            self.run = ShardedRun(engine, lambda: self.lightning_options, fixes=_FIXES)
        # Clipping by the global norm, fp16 skips agreed by every rank (precision.py).
        self.precision_plugin = sharded_precision(self.precision_plugin, engine, device=self.root_device)
        return _RootCall(module)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        engine = self.sharded_model()
        with whole_shapes(engine.sharded_params):  # engine/whole_matrix.py, Note: optimizers built on whole shapes
            super().setup_optimizers(trainer)
        shard_state_built_whole(engine, self.optimizers)
        sharded = {id(p.param) for p in engine.sharded_params}
        names = {id(p): name for name, p in engine.module.named_parameters()}
        for optimizer in self.optimizers:
            check_optimizer_fits_shards(optimizer, type(self).__name__, names=names)
            step_whole_matrices(engine, optimizer, type(self).__name__)  # torch.optim.Muon's steps
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if params and not any(id(p) in sharded for p in params):
                raise ValueError(
                    f"The optimizer {type(optimizer).__name__} does not reference any parameter of the sharded "
                    f"model. With {type(self).__name__}, create optimizers in `configure_optimizers()` from "
                    f"`self.parameters()` (or `self.named_parameters()`), which returns the shards."
                )

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # empty_init: parameters on the meta device, other tensors (buffers, metric states) real;
        # setup materialises, initialises and shards one module at a time (engine/materialize.py,
        # Note: only parameters on meta), so no rank ever holds the whole model. Otherwise the
        # model is built in host memory, as under Lightning's FSDP: whole on the device it could
        # fail before sharding; setup moves it there shard by shard.
        meta = parameters_on_meta(self.root_device) if empty_init else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # What `configure_model` builds has its parameters on the meta device, for the same reason.
        with parameters_on_meta(self.root_device):
            yield

    @override
    def model_to_device(self) -> None:
        # Called after sharding, which put the shards, persistent parameters and buffers on the
        # device one module at a time (engine/materialize.py, Note: sharding from host memory): a
        # whole model in host memory (built by `init_module()`) never goes to the device. What is left
        # (e.g. torchmetrics states) moves, and the LightningModule learns its device.
        assert self.lightning_module is not None
        self.sharded_model().move_module(self.root_device)  # offloaded shards stay on the host

    # ---- per-step accounting ------------------------------------------------------------
    # `stats["last_step"]` is the traffic of the last optimizer step: every micro-batch's
    # forward and backward since the step before it, and the step itself. Evaluation
    # traffic is left out.
    @override
    def on_train_start(self) -> None:
        self.sharded_model().stats.forget_traffic()
        self.sharded_model().stats.reset_peaks()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Ranks with uneven batch counts fail at the step where the shortest epoch ends, on every
        # rank (engine/checks.py, Note: uneven batches).
        assert self.lightning_module is not None
        self.sharded_model().mark_final_batch(_last_batch_of_epoch(self.lightning_module.trainer), fix=_UNEVEN_FIX)
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.sharded_model().stats.end_step()
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning runs the micro-batches before the last of `accumulate_grad_batches` in here:
        # with `accumulate_unsharded`, their gradients are summed locally (ShardedModel.no_sync).
        with self.sharded_model().no_sync() if self.lightning_options.accumulate_unsharded else nullcontext():
            yield

    @override
    def on_validation_end(self) -> None:
        if self.run is not None:
            self.run.engine.stats.forget_traffic()

    # ---- collectives Lightning uses for metrics/logging -----------------------------------
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return all_reduce(type(self).__name__, tensor, group, reduce_op)

    # ---- whole parameters on demand (and ShardedStrategy's, common/base.py) -----------------
    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, Tensor]:
        """The LightningModule's whole state dict, gathered one unit at a time into host memory,
        on rank 0 (others get {}) or with `rank0_only=False` on every rank. Collective: call it
        on every rank, during or after `fit` (where `module.state_dict()` is refused)."""
        return self._run_of().full_state_dict(rank0_only=rank0_only)

    # ---- accounting -------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """What this rank holds and sends: see docs/accounting.md."""
        return self.sharded_model().stats.report(self.optimizers)

    # ---- checkpoints (the run, common/run.py): "sharded" a directory, each rank its shards; "full" one
    # ordinary Lightning file from rank 0.
    def _run_of(self, module: nn.Module | None = None, *, within: bool = False) -> ShardedRun:  # one LightningModule
        if self.run is None:
            raise RuntimeError(
                f"{type(self).__name__} has no sharded model yet: it is built in `Trainer.fit/validate/test/"
                f"predict` setup. Call this from a LightningModule hook that runs after setup."
            )
        return self.run

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._run_of().model_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        return self._run_of().optimizer_state(getattr(optimizer, "optimizer", optimizer))  # a LightningOptimizer's own

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: the checkpoint "
                f"is written by {type(self).__name__}, not by a CheckpointIO plugin."
            )
        path = self.broadcast_checkpoint_path(filepath, saving=True)  # a path or a URL (Note: remote checkpoints)
        self._run_of().save(path, checkpoint, checkpoint_io_files(self.checkpoint_io).write)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = as_path(self.broadcast_checkpoint_path(checkpoint_path, saving=False))
        context = f"Cannot load the checkpoint {path}"
        strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
        read = checkpoint_io_files(self.checkpoint_io, weights_only=weights_only).read
        # A sharded checkpoint's dict holds its tensors still on disk (checkpoint/load.py, `open_checkpoint`).
        return self._run_of().open(
            path, read, weights_only=weights_only, strict=strict, context=context, key="state_dict"
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._run_of().load_model_state(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._run_of().load_optimizer_states(checkpoint["optimizer_states"], list(self.optimizers))

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            saving = self.run.saving if self.run is not None else None
            remove_checkpoint(filepath, checkpoint_io_files(self.checkpoint_io).remove, after=saving)

    # ---- teardown ---------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # other ranks may be gone: no collective in teardown

    @override
    def teardown(self) -> None:
        try:  # the last background save: its error is raised on every rank, after teardown
            if self.run is not None:
                self.run.wait_for_save(agree=not self._failed)
        finally:
            if self.run is not None and self.run.state is Lifecycle.SHARDED:
                self.run.end(failed=self._failed)  # left sharded, or at rest (common/run.py, Note: run lifecycle)
                self.model = self.lightning_module
            # Lightning's teardown without its moves of the module and optimizer state to the CPU,
            # as Lightning's FSDPStrategy: the shards stay on the device, whole nowhere.
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()


_FIXES = Fixes(  # named where a module's own (load_)state_dict() meets shards (common/run.py)
    read="For whole weights, read them inside `with trainer.strategy.gathered_parameters(model):` on every rank (there "
    "`state_dict()` of the model and of any submodule is whole), or call `trainer.strategy.full_state_dict()` on every "
    "rank (rank 0 gets them), or save a checkpoint with `trainer.save_checkpoint(path)`.",
    load="To load whole weights, call `model.load_state_dict(state_dict)` inside `with trainer.strategy."
    "gathered_parameters(model, modifier_rank=0):` on every rank (rank 0's load is kept), or resume from a checkpoint "
    "with `trainer.fit(model, ckpt_path=path)`, or load before `fit`, while the module is whole.",
)


_UNEVEN_FIX = (  # checks.py, Note: uneven batches
    "Lightning's DistributedSampler (`use_distributed_sampler=True`, the default, pads to equal lengths), "
    "`drop_last=True` on a sampler or DataLoader that splits data per rank, or equal per-rank datasets."
)


def _last_batch_of_epoch(trainer: Any) -> bool:
    """Whether the training step about to run takes the last batch of this rank's epoch, unless
    it ends the run by `max_steps` at a regular optimizer step, which every rank reaches alike
    whatever its loader holds (a step that flushes a short epoch's accumulation is not one)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    last = progress.is_last_batch or progress.current.ready >= trainer.num_training_batches
    regular_step = progress.current.ready % trainer.accumulate_grad_batches == 0
    return bool(last) and not (regular_step and 0 <= trainer.max_steps <= trainer.global_step + 1)


__all__ = ["ZeRO3Strategy"]
