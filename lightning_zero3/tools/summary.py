"""What users read about a sharded model: Lightning's model summary with the sizes of whole
parameters, not of this rank's shards (`ZeRO3Strategy.stats` is `ShardedModel.stats.report`), and those
figures per optimizer step in the user's logger (`ShardingStatsMonitor`; Fabric:
`fabric.log_dict(fabric.strategy.step_metrics(model))`).

[Note: ModelSummary._summary]
Lightning's `ModelSummary` callback (and `RichModelSummary`) builds its table in the private
method `_summary(trainer, pl_module)`, which counts `p.numel()`: with shards, 1/N of every layer.
No public hook lets a strategy supply the counts, so the strategy replaces `_summary` on each
such callback (with a picklable partial). Private names used: the callback's `_summary` and
`_max_depth`; the summary's `_model` and `_max_depth` and `LayerSummary._module`, read as
Lightning's own subclasses do. Tried: Lightning 2.6.6. Fallback: without `_summary` or
`_max_depth` nothing is set and a warning says the table shows shard sizes.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as Summary
from torch import Tensor
from typing_extensions import override


def count_full_parameters(callbacks: Iterable[Any], numel: Callable[[Tensor], int]) -> None:
    """Make every `ModelSummary` callback count `numel(p)` elements for parameter `p`."""
    for callback in callbacks:
        if not isinstance(callback, ModelSummary):
            continue
        if not callable(getattr(callback, "_summary", None)) or not hasattr(callback, "_max_depth"):
            warnings.warn(
                f"{type(callback).__name__} changed in this Lightning version: its table counts this rank's "
                f"shards (1/N of each parameter), not whole parameters.",
                stacklevel=2,
            )
            continue
        callback._summary = partial(_summary, callback._max_depth, numel)  # type: ignore[method-assign]


def _summary(max_depth: int, numel: Callable[[Tensor], int], trainer: Any, pl_module: Any) -> Summary:
    return FullSizeSummary(pl_module, max_depth=max_depth, numel=numel)


class FullSizeSummary(Summary):
    """Lightning's model summary counting whole parameters rather than this rank's shards."""

    def __init__(self, model: Any, *, max_depth: int, numel: Callable[[Tensor], int]) -> None:
        self._numel = numel
        super().__init__(model, max_depth=max_depth)

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        numel = self._numel

        class _Layer(LayerSummary):
            @property
            def num_parameters(self) -> int:
                return sum(numel(p) for p in self._module.parameters())

        summary: dict[str, LayerSummary] = OrderedDict((name, _Layer(module)) for name, module in self.named_modules)
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for key in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[key]
        return summary

    @property
    @override
    def total_parameters(self) -> int:
        return sum(self._numel(p) for p in self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        return sum(self._numel(p) for p in self._model.parameters() if p.requires_grad)


def step_metrics(stats: dict[str, Any], device: torch.device, prefix: str = "zero3/") -> dict[str, float]:
    """`stats` (`ShardedModel.report`) of the last optimizer step as flat numbers for a logger: the
    payload bytes of each collective kind and the formula's figure for them (`<kind>_bytes`,
    `<kind>_bytes_formula`; "_across_groups" with `shard_size`, "_in_slice_groups" with
    `reshard_after_forward=G`), seconds waiting for All-Gathers, the peak of units whole since
    fit started, and this process's memory: CUDA's `max_memory_allocated` on a CUDA device,
    else the anonymous RSS (Linux), the memory the model, gradients and buffers live in."""
    metrics: dict[str, float] = {}
    for group in ("", "_across_groups", "_in_slice_groups"):
        for kind, counted in stats[f"last_step{group}"].items():
            metrics[f"{kind}_bytes{group}"] = counted["payload_bytes"]
        for kind, formula in stats[f"expected_step_bytes{group}"].items():
            if formula or f"{kind}_bytes{group}" in metrics:
                metrics[f"{kind}_bytes{group}_formula"] = formula
    metrics["gather_wait_s"] = stats["gather_wait_s"]
    metrics["peak_units_alive"] = stats["peak_units_alive"]
    if device.type == "cuda":
        metrics["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    elif (anonymous := _rss_anon_bytes()) is not None:
        metrics["rss_anon_bytes"] = anonymous
    return {prefix + name: float(value) for name, value in metrics.items()}


def _rss_anon_bytes() -> int | None:
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))
    except (OSError, StopIteration):  # not Linux
        return None


class ShardingStatsMonitor(Callback):
    """Logs what `ZeRO3Strategy` measured in each optimizer step (`step_metrics`: bytes per
    collective and the formula's, All-Gather wait, units whole at the peak, memory) to the
    Trainer's loggers, as Lightning's `DeviceStatsMonitor` logs device statistics: rank 0's
    figures, at the step Lightning's own `self.log` uses, so each optimizer step is one row (its
    `train_loss` beside the figures). With `accumulate_grad_batches=k`, once per k batches.
    On a GPU, reading the wait times the step's CUDA events (a sync per step)."""

    def __init__(self, prefix: str = "zero3/") -> None:
        self.prefix = prefix
        self._logged_step = -1  # the last optimizer step logged

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise MisconfigurationException("Cannot use ShardingStatsMonitor with Trainer(logger=False): add a logger.")
        if not hasattr(type(trainer.strategy), "sharded_model"):  # ZeRO3Strategy's (strategy.py imports this file)
            raise MisconfigurationException(
                f"ShardingStatsMonitor logs what lightning_zero3's strategy measures; the Trainer's strategy is "
                f"{type(trainer.strategy).__name__}. Use strategy='zero3' or remove the callback."
            )

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._logged_step = trainer.global_step  # a resumed fit: its first step is a new one

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._logged_step or not trainer.is_global_zero:
            return  # no optimizer step since the last log (accumulating), or not the logging rank
        self._logged_step = trainer.global_step
        metrics = step_metrics(trainer.strategy.stats, trainer.strategy.root_device, self.prefix)
        # The step Lightning logs `self.log` values at, and DeviceStatsMonitor's (common/base.py, Note:
        # Lightning's private names); without it, this step's number before its increment.
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step - 1)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


__all__ = ["FullSizeSummary", "ShardingStatsMonitor", "count_full_parameters", "step_metrics"]
