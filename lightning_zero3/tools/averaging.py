"""Weight averaging (EMA, SWA) on shards: Lightning's `WeightAveraging` and `EMAWeightAveraging`
for `ZeRO3Strategy`, with the same arguments, schedule and results, in 1/N of the memory.

    from lightning_zero3 import ShardedEMAWeightAveraging
    trainer = Trainer(strategy="zero3", callbacks=[ShardedEMAWeightAveraging(decay=0.999)])

[Note: averages in the optimizer state]
An average is elementwise, so it lives on the shards as the optimizer state's entry "averaged":
saved and resharded by the optimizer state's code, nothing added to the checkpoint format
(docs/design.md, averages in the optimizer state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.optim.swa_utils import get_ema_avg_fn, get_swa_avg_fn
from typing_extensions import override

AVERAGED = "averaged"  # the optimizer-state key (Note: averages in the optimizer state)
AvgFn = Callable[[Tensor, Tensor, Tensor | int], Tensor]


class ShardedWeightAveraging(Callback):
    """Lightning's `WeightAveraging` on this rank's shards (Note: averages in the optimizer
    state). `avg_fn(averaged, current, num_averaged)` as for torch's `AveragedModel` (default:
    SWA's equal weights); override `should_update` to choose when, as with Lightning's."""

    def __init__(self, *, avg_fn: AvgFn | None = None, use_buffers: bool = True) -> None:
        self.avg_fn = avg_fn
        self.use_buffers = use_buffers
        self.num_averaged = 0
        self.buffer_averages: dict[str, Tensor] = {}
        # As in Lightning's callback: the optimizer steps and the epoch of the last update.
        self._latest_update_step = 0
        self._latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """After each optimizer step (`step_idx`, zero-based) or epoch (`epoch_idx`): update?"""
        return step_idx is not None

    def average_fn(self) -> AvgFn:
        # Built when used, not kept: torch's avg functions are closures, which do not pickle, and
        # a spawning launcher (spawn, forkserver) pickles the Trainer with its callbacks.
        return self.avg_fn or get_swa_avg_fn()

    # ---- when, as Lightning's WeightAveraging --------------------------------------------------
    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=trainer.global_step - 1):
            self.update(trainer, pl_module)
            self._latest_update_step = trainer.global_step

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(epoch_idx=trainer.current_epoch):
            self.update(trainer, pl_module)
            self._latest_update_epoch = trainer.current_epoch

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and self.num_averaged:  # the average swapped in, then back out
            self._swap(trainer, pl_module)

    on_validation_epoch_end = on_validation_epoch_start

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.num_averaged:
            return
        with torch.no_grad():
            for current, averaged in self._pairs(trainer, pl_module):
                current.copy_(averaged)

    # ---- what ------------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """One averaging step of every parameter the optimizers hold (and of the buffers)."""
        average = self.average_fn()
        for table, key, current in self._averaged(trainer, pl_module):
            if self.num_averaged == 0 or key not in table:
                table[key] = current.clone()
            else:
                table[key].copy_(average(table[key], current, self.num_averaged))
        self.num_averaged += 1

    def _averaged(self, trainer: Trainer, pl_module: LightningModule) -> list[tuple[dict[str, Any], str, Tensor]]:
        """(the table holding its average, the key there, the current tensor) for every tensor
        averaged: the optimizers' parameters, then the buffers."""
        optimizers = trainer.optimizers
        found = [(o.state[p], AVERAGED, p.detach()) for o in optimizers for g in o.param_groups for p in g["params"]]
        if self.use_buffers:
            found += [(self.buffer_averages, name, buffer.detach()) for name, buffer in pl_module.named_buffers()]
        return found

    def _pairs(self, trainer: Trainer, pl_module: LightningModule) -> list[tuple[Tensor, Tensor]]:
        """(current, its average) for every tensor with an average."""
        return [(current, table[key]) for table, key, current in self._averaged(trainer, pl_module) if key in table]

    @torch.no_grad()
    def _swap(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for current, averaged in self._pairs(trainer, pl_module):
            kept = current.clone()
            current.copy_(averaged)
            averaged.copy_(kept)

    # ---- checkpoints: the counts and buffer averages; parameter averages ride in the optimizer state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "num_averaged": self.num_averaged,
            "latest_update_step": self._latest_update_step,
            "latest_update_epoch": self._latest_update_epoch,
            "buffer_averages": dict(self.buffer_averages),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.num_averaged = int(state_dict["num_averaged"])
        self._latest_update_step = int(state_dict["latest_update_step"])
        self._latest_update_epoch = int(state_dict["latest_update_epoch"])
        self.buffer_averages = {name: t.clone() for name, t in state_dict["buffer_averages"].items()}


class ShardedEMAWeightAveraging(ShardedWeightAveraging):
    """Lightning's `EMAWeightAveraging` on shards: the same arguments and schedule."""

    def __init__(
        self,
        *,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        use_buffers: bool = True,
    ) -> None:
        super().__init__(use_buffers=use_buffers)
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    @override
    def average_fn(self) -> AvgFn:
        return get_ema_avg_fn(decay=self.decay)

    @override
    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        return (
            epoch_idx is not None
            and self.update_starting_at_epoch is not None
            and epoch_idx >= self.update_starting_at_epoch
        )


__all__ = ["ShardedEMAWeightAveraging", "ShardedWeightAveraging"]
