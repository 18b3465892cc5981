"""Lightning's tests_pytorch/callbacks/test_weight_averaging.py, adapted with the strategy as a
parameter (2 CPU ranks started by the strategy's launcher, as there). DDP runs WeightAveraging (an
EMA) as Lightning's test does; zero3 refuses it at setup with the message of
lightning_zero3/tools/callbacks.py (the averaged copy would be whole while the live parameters are 1-D
shards; lightning_zero3's ShardedEMAWeightAveraging keeps the EMA on the shards instead, tested in
tests/lightning/test_averaging.py).

The model is built here and pickled to the ranks. Lightning's launcher gives each rank a private
copy of its tensors under "spawn" only (`_disable_module_memory_sharing`, as in Lightning's test,
on ddp_spawn); under "forkserver" the ranks would receive one copy in shared memory and train it
together, so the rank writing last after `_copy_average_to_current` made DDP's
`weights_are_the_average` fail now and then: `EmaModel.setup` makes the copy private."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import Tensor, nn
from torch.utils.data import DataLoader

from tests.support.adapted import STRATEGIES, WORLD_SIZE, hand_back, launched, lightning_trainer

MAX_EPOCHS = 2
STEPS_PER_EPOCH = 4 // WORLD_SIZE  # 32 samples, batches of 4, accumulate 2: 4 steps on one process


class EmaModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

    def setup(self, stage: str) -> None:
        with torch.no_grad():
            for tensor in itertools.chain(self.parameters(), self.buffers()):
                tensor.data = tensor.data.clone()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class EmaFunction:
    """Lightning's EMAAveragingFunction (a class, so that it pickles)."""

    @torch.no_grad()
    def __call__(self, ema_param: Tensor, current_param: Tensor, num_averaged: Tensor) -> Tensor:
        return 0.9 * ema_param + 0.1 * current_param


class CountingEMA(WeightAveraging):
    """Lightning's EMATestCallback, shortened: counts swaps (around each validation) and the
    final copy of the average into the model."""

    def __init__(self) -> None:
        super().__init__(avg_fn=EmaFunction())
        self.swaps = 0
        self.copies = 0
        self.averaged_at_epoch_end: list[int] = []

    def _swap_models(self, *args: Any, **kwargs: Any) -> None:
        self.swaps += 1
        super()._swap_models(*args, **kwargs)

    def _copy_average_to_current(self, *args: Any, **kwargs: Any) -> None:
        self.copies += 1
        super()._copy_average_to_current(*args, **kwargs)

    def on_train_epoch_end(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_end(trainer, *args)
        assert self._average_model is not None
        self.averaged_at_epoch_end.append(int(self._average_model.n_averaged))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        assert self._average_model is not None
        average = self._average_model.module.parameters()
        hand_back(
            trainer, averaged_at_epoch_end=self.averaged_at_epoch_end, swaps=self.swaps, copies=self.copies,
            weights_are_the_average=all(torch.equal(p, q) for p, q in zip(pl_module.parameters(), average)),
        )  # fmt: skip


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ema_ddp_spawn_cpu(strategy: str, tmp_path) -> None:
    """Adapted from `test_ema_ddp_spawn_cpu` (EMATestCallback(devices=2) on ddp_spawn, 2 CPU
    devices), with 2 epochs instead of 8: what rank 0's callback counted, handed back."""
    trainer = lightning_trainer(
        launched(strategy), tmp_path, max_epochs=MAX_EPOCHS, limit_val_batches=2, num_sanity_val_steps=0,
        accumulate_grad_batches=2, callbacks=[CountingEMA()], enable_checkpointing=False,
    )  # fmt: skip
    data = DataLoader(RandomDataset(32, 32), batch_size=4, shuffle=False)
    if strategy == "zero3":
        refusal = "CountingEMA is not supported by ZeRO3Strategy: it averages a whole copy"
        with pytest.raises(Exception, match=refusal) as err:
            trainer.fit(EmaModel(), data)
        assert "lightning_zero3.ShardedWeightAveraging or ShardedEMAWeightAveraging" in str(err.value)
        return
    trainer.fit(EmaModel(), data)
    result = trainer.callback_metrics
    assert result["averaged_at_epoch_end"].tolist() == [STEPS_PER_EPOCH * (e + 1) for e in range(MAX_EPOCHS)]
    assert result["swaps"] == MAX_EPOCHS * 2  # into and out of the average around each validation
    assert result["copies"] == 1 and result["weights_are_the_average"]
