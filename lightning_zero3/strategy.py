"""`ZeRO3Strategy`: the Lightning glue around the framework-independent engine.

It owns the setup order (shard after the model is on its device, build optimizers after
sharding), the process group, the precision plugin's clipping, checkpoints and the accounting
users read in `strategy.stats`. It never calls a collective on parameter data itself: the
engine does.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
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

from lightning_zero3 import trainer_checkpoint
from lightning_zero3.callbacks import refuse_unsupported_callbacks
from lightning_zero3.engine import ShardedModel, check_optimizer_fits_shards
from lightning_zero3.engine.materialize import parameters_on_meta
from lightning_zero3.engine.plan import WrapPolicy
from lightning_zero3.options import (
    OptionAttribute,
    RanksAndDevices,
    all_reduce,
    mixed_precision_dtype,
    optimizer_state_to,
    validated_options,
)
from lightning_zero3.precision import sharded_precision
from lightning_zero3.summary import count_full_parameters, sharded_stats


class _RootCall(nn.Module):
    """A thin wrapper so that Lightning's forward redirection (`training_step` etc. routed
    through `wrapper(...)`) runs the LightningModule's forward hooks, which gather the root
    unit for the whole step."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ZeRO3Strategy(RanksAndDevices, ParallelStrategy):
    """ZeRO stage 3: parameters, gradients and optimizer state partitioned 1/N over ranks.

    Args:
        wrap_policy: which modules form units (gathered together). None: each repeated child
            of an ``nn.ModuleList``/``nn.Sequential`` that holds parameters; or a set of module
            classes; or ``callable(module) -> bool``.
        prefetch: units All-Gathered ahead of the one computing (0 turns prefetch off).
        persistence_threshold: parameters with at most this many elements stay whole on every
            rank; their gradients are All-Reduced.
        shard_size: hierarchical sharding: shard within groups of this many consecutive ranks
            (e.g. the processes of one node) and replicate across groups. Gathers stay inside a
            group; only 1/shard_size of each gradient crosses between groups. Model state per
            rank is 16Ψ/shard_size bytes. None (default): shard over the whole world.
        param_dtype: dtype parameters are gathered and computed in (e.g. "bf16"). Default: what
            the Trainer's precision implies ("bf16-mixed" -> bf16, "16-mixed" -> fp16), else the
            model's dtype. The shards, the optimizer's master copy, keep the model's dtype.
        reduce_dtype: dtype gradients are reduce-scattered in. Default fp32 (exact); "bf16"
            halves the gradient traffic.
        param_init_fn: initialises one module's own parameters when the model was built on the
            meta device (in ``configure_model`` or ``trainer.init_module(empty_init=True)``).
            Default: the module's ``reset_parameters()``.
        state_dict_type: "sharded" or "full" checkpoints.
        trust_checkpoint: load checkpoints with plain pickle (DCP's index, trainer_state.pt, full
            files with ``weights_only=False``), which can run code from the file: only for
            checkpoints from a trusted source whose Lightning state holds arbitrary objects. Default
            False: nothing in a checkpoint runs code (docs/checkpoints.md, "What loading trusts").
            ``trainer.fit(..., weights_only=False)`` does not reach this strategy: Lightning passes
            it only to strategies that restore before setup, and this one restores after.
        timeout: process-group timeout: a rank that never arrives fails the others after it.
        start_method: "popen" (re-run the script per rank, default), or a multiprocessing start
            method ("spawn", "fork", "forkserver").
        reductions_in_flight: gradient Reduce-Scatters left running while backward continues
            (each holds one unit's full gradient buffer). None (default): 2 on CUDA, 0 elsewhere
            (on CPU/gloo no gain was measured).
        cpu_transport: how CPU tensors' All-Gathers and Reduce-Scatters travel: "process_group"
            (default: gloo, loopback TCP between ranks on one host) or "shared_memory" (a file in
            /dev/shm mapped by every rank; all ranks of a shard group must be on one host; see
            docs/performance.md, "Shared-memory transport"). No effect on CUDA tensors.
    """

    strategy_name = "zero3"

    # The options live in `self.options` (a validated `ShardingOptions`, as in the Fabric
    # strategy); these public names read them and, assigned, replace them validated.
    wrap_policy = OptionAttribute()
    prefetch = OptionAttribute()
    persistence_threshold = OptionAttribute()
    shard_size = OptionAttribute()
    param_dtype = OptionAttribute()
    reduce_dtype = OptionAttribute()
    param_init_fn = OptionAttribute()
    state_dict_type = OptionAttribute()
    trust_checkpoint = OptionAttribute()
    timeout = OptionAttribute()
    start_method = OptionAttribute()
    reductions_in_flight = OptionAttribute()
    cpu_transport = OptionAttribute()

    def __init__(
        self,
        *,
        wrap_policy: WrapPolicy = None,
        prefetch: int = 1,
        persistence_threshold: int = 0,
        shard_size: int | None = None,
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        trust_checkpoint: bool = False,
        timeout: timedelta = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        reductions_in_flight: int | None = None,
        cpu_transport: Literal["process_group", "shared_memory"] = "process_group",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = validated_options(
            type(self).__name__, wrap_policy=wrap_policy, prefetch=prefetch,
            persistence_threshold=persistence_threshold, shard_size=shard_size, param_dtype=param_dtype,
            reduce_dtype=reduce_dtype, param_init_fn=param_init_fn, state_dict_type=state_dict_type,
            timeout=timeout, start_method=start_method, reductions_in_flight=reductions_in_flight,
            trust_checkpoint=trust_checkpoint, cpu_transport=cpu_transport,
        )  # fmt: skip
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        # The engine that holds this run's shards; None outside setup..teardown.
        self.sharded: ShardedModel | None = None
        # True after teardown put whole parameters back on the module.
        self.whole = False
        self._failed = False

    @override
    def __getstate__(self) -> dict[str, Any]:
        # The engine holds this process's process groups and hooks; a pickled strategy (as in
        # `torch.save(trainer)`) leaves it behind, like Lightning's DDP drops its process group.
        return {**super().__getstate__(), "sharded": None}

    # ---- what Lightning asks of a distributed strategy (and RanksAndDevices in options.py) ----
    @property
    def is_distributed(self) -> bool:
        # Lightning only knows its own strategies as distributed; without this no
        # DistributedSampler is inserted and `self.log(..., sync_dist=True)` does nothing.
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the shards, after sharding and optimizer creation

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.options.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            # Teardown makes parameters whole again, so the launcher's copy of rank 0's
            # state_dict back into the main process has full shapes.
            self._launcher = _MultiProcessingLauncher(self, start_method=self.options.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.join_world(self.options.timeout)  # options.py: RanksAndDevices

    # ---- setup ------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        refuse_unsupported_callbacks(trainer.callbacks, type(self).__name__)  # callbacks.py: why and what instead
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self._failed = False
        self.whole = False
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self._setup_model(self.model)  # shards on the device, from wherever the module is
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizer_state_to(self.optimizers, self.root_device)
        count_full_parameters(trainer.callbacks, self.sharded_model.full_numel)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        module = self.lightning_module
        assert module is not None
        narrow = self.param_dtype is not None and self.param_dtype.itemsize < 4
        if narrow and type(self.precision_plugin) is Precision:
            raise ValueError(
                f"{type(self).__name__}(param_dtype={self.param_dtype}) computes in 16 bits, but the Trainer's "
                f"precision is 32-true, so inputs stay fp32 and the first layer fails on mixed dtypes. Use "
                f"Trainer(precision='bf16-mixed') (autocast; param_dtype then defaults to bf16) or cast inputs."
            )
        self.sharded = ShardedModel(
            module,
            wrap_policy=self.wrap_policy,
            prefetch=self.prefetch,
            persistence_threshold=self.persistence_threshold,
            shard_size=self.shard_size if self.shard_size != self.world_size else None,
            param_dtype=self.param_dtype or mixed_precision_dtype(getattr(self.precision_plugin, "precision", "")),
            reduce_dtype=self.reduce_dtype,
            param_init_fn=self.param_init_fn,
            device=self.root_device,
            reductions_in_flight=self.reductions_in_flight,
        )
        # Clipping by the global norm, fp16 skips agreed by every rank (precision.py).
        self.precision_plugin = sharded_precision(self.precision_plugin, self.sharded, device=self.root_device)
        return _RootCall(module)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        sharded = {id(p.param) for p in self.sharded_model.sharded_params}
        for optimizer in self.optimizers:
            check_optimizer_fits_shards(optimizer, type(self).__name__)
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
        # Note: only parameters on meta), so no rank ever holds the whole model.
        device = self.root_device
        with parameters_on_meta(device) if empty_init else device, self.precision_plugin.tensor_init_context():
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
        # whole model in host memory, as after a teardown, never goes to the device. What is left
        # (e.g. torchmetrics states) moves, and the LightningModule learns its device.
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    @property
    def sharded_model(self) -> ShardedModel:
        if self.sharded is None:
            raise RuntimeError(
                f"{type(self).__name__} has no sharded model yet: it is built in `Trainer.fit/validate/test/"
                f"predict` setup. Call this from a LightningModule hook that runs after setup."
            )
        return self.sharded

    # ---- per-step accounting ------------------------------------------------------------
    # `stats["last_step"]` is the traffic of the last optimizer step: every micro-batch's
    # forward and backward since the step before it, and the step itself. Evaluation
    # traffic is left out.
    @override
    def on_train_start(self) -> None:
        self.sharded_model.stats.current.clear()
        if self.sharded_model.replicate_stats is not None:
            self.sharded_model.replicate_stats.current.clear()
        self.sharded_model.reset_peaks()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.sharded_model.end_step()
        return output

    @override
    def on_validation_end(self) -> None:
        if self.sharded is not None:
            self.sharded.stats.current.clear()
            if self.sharded.replicate_stats is not None:
                self.sharded.replicate_stats.current.clear()

    # ---- collectives Lightning uses for metrics/logging -----------------------------------
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return all_reduce(tensor, group, reduce_op)

    # ---- whole parameters on demand -------------------------------------------------------
    @contextmanager
    def gathered_parameters(
        self, module: nn.Module | None = None, *, modifier_rank: int | None = None
    ) -> Generator[None, None, None]:
        """Make `module`'s parameters (default: the whole LightningModule) whole on every rank
        inside the block. With `modifier_rank=r`, what rank r wrote is kept on exit."""
        with self.sharded_model.gathered_parameters(module, modifier_rank=modifier_rank):
            yield

    @contextmanager
    def gathered_for_inference(self) -> Generator[None, None, None]:
        """Keep every unit gathered inside the block (no gradients), so `generate()` and
        evaluation run at DDP's speed; see `ShardedModel.gathered_for_inference`."""
        with self.sharded_model.gathered_for_inference():
            yield

    # ---- accounting -------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """What this rank holds and sends: see docs/accounting.md."""
        return sharded_stats(self.sharded_model, self.optimizers)

    # ---- checkpoints (lightning_zero3/trainer_checkpoint.py) -------------------------------
    # "sharded": a directory, each rank its shards; "full": one ordinary Lightning file from rank 0.
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return trainer_checkpoint.lightning_module_state_dict(self)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        return trainer_checkpoint.optimizer_state(self, optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        trainer_checkpoint.save_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        return trainer_checkpoint.load_checkpoint(self, checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        trainer_checkpoint.load_model_state_dict(self, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        trainer_checkpoint.load_optimizer_state_dict(self, checkpoint)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        trainer_checkpoint.remove_checkpoint(self, filepath)

    # ---- teardown ---------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # other ranks may be gone: no collective in teardown

    @override
    def teardown(self) -> None:
        if self.sharded is not None and not self.whole:
            if self._failed:
                # Other ranks may be gone: the module stays sharded (and savable) until the next
                # engine built for it makes it whole (engine/left_sharded.py).
                self.sharded.leave_sharded()
            else:
                # Whole parameters in host memory, one unit at a time, as Lightning moves
                # every model to the CPU at teardown anyway (engine: restore_module).
                self.sharded.restore_module(device="cpu")
                # Kept for `stats` and for saving the optimizer (its state is still sharded).
                self.whole = True
            self.model = self.lightning_module
        module = self.lightning_module
        if module is not None and any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            # Setup failed while the module was still (partly) on the meta device, e.g. a module
            # without reset_parameters() built in configure_model(): Lightning's move to the CPU
            # would raise "Cannot copy out of meta tensor" and hide that error. Skip the move.
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "zero3" not in strategy_registry:
            strategy_registry.register("zero3", cls, description="ZeRO stage 3 (lightning_zero3)")

    def __repr__(self) -> str:
        # Shown by Fabric when given this class: say which one it wants.
        return f"{type(self).__name__}(a Trainer strategy: for Fabric use ZeRO3FabricStrategy or strategy='zero3')"


__all__ = ["ZeRO3Strategy"]
