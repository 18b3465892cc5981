"""Lightning's tests_pytorch/callbacks/test_weight_averaging.py, adapted with the strategy as a
parameter (2 gloo CPU ranks). DDP runs WeightAveraging (an EMA) as Lightning's test does; zero3
refuses it at setup, on every rank, with the message of lightning_zero3/callbacks.py (the averaged
copy would be whole while the live parameters are 1-D shards; lightning_zero3's
ShardedEMAWeightAveraging keeps the EMA on the shards instead, tested in tests/test_averaging.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.utils.data import DataLoader

from tests.adapted import STRATEGIES, WORLD_SIZE, lightning_trainer, on_ranks

MAX_EPOCHS = 2
STEPS_PER_EPOCH = 4 // WORLD_SIZE  # 32 samples, batches of 4, accumulate 2: 4 steps on one process


class EmaModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

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


def _fit_with_ema(rank: int, strategy: str, root: str) -> dict[str, Any]:
    ema = CountingEMA()
    trainer = lightning_trainer(
        strategy, root, max_epochs=MAX_EPOCHS, limit_val_batches=2, num_sanity_val_steps=0, accumulate_grad_batches=2,
        callbacks=[ema], enable_checkpointing=False,
    )  # fmt: skip
    model = EmaModel()
    try:
        trainer.fit(model, DataLoader(RandomDataset(32, 32), batch_size=4, shuffle=False))
    except MisconfigurationException as err:
        return {"refused": str(err)}
    assert ema._average_model is not None
    average = ema._average_model.module
    return {
        "averaged_at_epoch_end": ema.averaged_at_epoch_end,
        "swaps": ema.swaps,
        "copies": ema.copies,
        "weights_are_the_average": all(torch.equal(p, q) for p, q in zip(model.parameters(), average.parameters())),
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ema_ddp_spawn_cpu(strategy: str, tmp_path) -> None:
    """Adapted from `test_ema_ddp_spawn_cpu` (EMATestCallback(devices=2) on ddp_spawn, 2 CPU
    devices), with 2 epochs instead of 8."""
    for result in on_ranks(_fit_with_ema, strategy, str(tmp_path)):
        if strategy == "zero3":
            assert "CountingEMA is not supported by ZeRO3Strategy: it averages a whole copy" in result["refused"]
            assert "lightning_zero3.ShardedWeightAveraging or ShardedEMAWeightAveraging" in result["refused"]
            continue
        assert result["averaged_at_epoch_end"] == [STEPS_PER_EPOCH * (e + 1) for e in range(MAX_EPOCHS)]
        assert result["swaps"] == MAX_EPOCHS * 2  # into and out of the average around each validation
        assert result["copies"] == 1 and result["weights_are_the_average"]
