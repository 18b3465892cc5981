"""Weight averaging (EMA, SWA) on shards: Lightning's `WeightAveraging` and `EMAWeightAveraging`
for `ZeRO3Strategy`, with the same arguments, schedule and results, in 1/N of the memory.

    from lightning_zero3 import ShardedEMAWeightAveraging
    trainer = Trainer(strategy="zero3", callbacks=[ShardedEMAWeightAveraging(decay=0.999)])

[Note: averages in the optimizer state]
Lightning's callbacks `deepcopy` the whole LightningModule before sharding and average it with
the live parameters, which under ZeRO-3 are this rank's 1-D shards (refused: callbacks.py). An
average is elementwise, so it is kept on the shards: each parameter's running average is the
entry "averaged" of its optimizer state, shard-shaped, as schedule-free optimizers keep their
averaged iterate. So it is saved, sharded or full, and resharded on resume at another world size
by the code that saves the optimizer state, with nothing added to the checkpoint format; buffers
(whole on every rank) and the update counts are the callback's own state. The differences from
Lightning's callbacks: a parameter no optimizer holds is not averaged (it does not change in
training, so its average is itself), and a checkpoint's "state_dict" holds the current weights
(Lightning's puts the average there and the current ones under "current_model_state"): load a
mid-training checkpoint into the callback's run to continue, or take the average from the
optimizer state. At the end of `fit` the average is copied into the model, as Lightning does.
Buffers (BatchNorm statistics) are each rank's own under this strategy, where DDP broadcasts rank
0's at every forward: averaged buffers then differ by rank as the buffers do (use SyncBatchNorm,
or `use_buffers=False`, for DDP's numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
        self.avg_fn = avg_fn or get_swa_avg_fn()
        self.use_buffers = use_buffers
        self.num_averaged = 0
        self.buffer_averages: dict[str, Tensor] = {}
        # As in Lightning's callback: the optimizer steps and the epoch of the last update.
        self._latest_update_step = 0
        self._latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """After each optimizer step (`step_idx`, zero-based) or epoch (`epoch_idx`): update?"""
        return step_idx is not None

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
        if trainer.state.fn == "fit" and self.num_averaged:
            self._swap(trainer, pl_module)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and self.num_averaged:
            self._swap(trainer, pl_module)

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
        first = self.num_averaged == 0
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    state = optimizer.state[param]
                    if first or AVERAGED not in state:
                        state[AVERAGED] = param.detach().clone()
                    else:
                        state[AVERAGED].copy_(self.avg_fn(state[AVERAGED], param.detach(), self.num_averaged))
        if self.use_buffers:
            for name, buffer in pl_module.named_buffers():
                average = self.buffer_averages.get(name)
                if first or average is None:
                    self.buffer_averages[name] = buffer.detach().clone()
                else:
                    average.copy_(self.avg_fn(average, buffer.detach(), self.num_averaged))
        self.num_averaged += 1

    def _pairs(self, trainer: Trainer, pl_module: LightningModule) -> Iterator[tuple[Tensor, Tensor]]:
        """(current, its average) for every averaged tensor."""
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if AVERAGED in optimizer.state[param]:
                        yield param.detach(), optimizer.state[param][AVERAGED]
        if self.use_buffers:
            buffers = dict(pl_module.named_buffers())
            for name, average in self.buffer_averages.items():
                if name in buffers:
                    yield buffers[name], average

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
        super().__init__(avg_fn=get_ema_avg_fn(decay=decay), use_buffers=use_buffers)
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

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
