"""What users read about a sharded model: Lightning's model summary with the sizes of whole
parameters, not of this rank's shards (`ZeRO3Strategy.stats` is `ShardedModel.report`).

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

from lightning.pytorch.callbacks import ModelSummary
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


__all__ = ["FullSizeSummary", "count_full_parameters"]
