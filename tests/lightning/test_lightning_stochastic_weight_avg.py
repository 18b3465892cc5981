"""Lightning's tests_pytorch/callbacks/test_stochastic_weight_avg.py, adapted with the strategy as a
parameter (2 CPU ranks started by the strategy's launcher, as there). DDP runs
StochasticWeightAveraging as Lightning's test does; zero3 refuses the callback at setup with the
message of lightning_zero3/tools/callbacks.py (the averaged copy would be whole while the live parameters
are 1-D shards)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader

from tests.support.adapted import STRATEGIES, hand_back, launched, lightning_trainer

MAX_EPOCHS, SWA_EPOCH_START, BATCHES = 3, 2, 4  # averaging from the 2nd epoch (0-based 1)


class SwaModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=2)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)}


class CountingSWA(StochasticWeightAveraging):
    """Lightning's SwaTestCallback, shortened: counts averaging, the final transfer and backward
    calls, and hands them back (with the Trainer's settings, which the extra batch-norm epoch
    changes and puts back) from rank 0."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.updates = 0
        self.transfers = 0
        self.backwards = 0

    def update_parameters(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.updates += 1
        StochasticWeightAveraging.update_parameters(*args, **kwargs)

    def transfer_weights(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.transfers += 1
        StochasticWeightAveraging.transfer_weights(*args, **kwargs)

    def on_before_backward(self, *args: Any) -> None:
        self.backwards += 1

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        hand_back(
            trainer, updates=self.updates, swa_start=self.swa_start, transfers=self.transfers,
            backwards=self.backwards, max_epochs=trainer.max_epochs, accumulate=trainer.accumulate_grad_batches,
        )  # fmt: skip


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_swa_callback_ddp_cpu(strategy: str, tmp_path) -> None:
    """Adapted from `test_swa_callback_ddp_cpu` (train_with_swa on ddp_spawn, 2 CPU devices),
    with fewer epochs and batches; zero3's refusal is what Lightning's
    `test_misconfiguration_error_with_sharded_model` expects of its FSDP and DeepSpeed."""
    swa = CountingSWA(swa_epoch_start=SWA_EPOCH_START, swa_lrs=0.1)
    trainer = lightning_trainer(
        launched(strategy), tmp_path, max_epochs=MAX_EPOCHS, limit_train_batches=BATCHES, limit_val_batches=0,
        accumulate_grad_batches=2, callbacks=[swa], enable_checkpointing=False,
    )  # fmt: skip
    if strategy == "zero3":
        refusal = "CountingSWA is not supported by ZeRO3Strategy: it averages a whole copy"
        with pytest.raises(Exception, match=refusal) as err:
            trainer.fit(SwaModel())
        assert "lightning_zero3.ShardedWeightAveraging or ShardedEMAWeightAveraging" in str(err.value)
        return
    trainer.fit(SwaModel())
    result = {k: int(v) for k, v in trainer.callback_metrics.items()}
    assert result["swa_start"] == 1 and result["updates"] == MAX_EPOCHS - 1 and result["transfers"] == 1
    # The extra batch-norm epoch runs forward only; the Trainer's settings are put back.
    assert result["backwards"] == MAX_EPOCHS * BATCHES
    assert result["max_epochs"] == MAX_EPOCHS and result["accumulate"] == 2
