"""Under the Trainer: a callback that calls the inner model directly, under inference_mode,
no_grad and grad, before training; training afterwards equals the single-process reference."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from tests.lit import (
    LitMLP,
    become_lightning_rank,
    dataset,
    loader,
    max_difference,
    reference_fit,
    trainer,
    whole_state,
)
from tests.ranks import run_ranks


class SampleInnerModel(pl.Callback):
    """What a sampling callback does: `pl_module.net(x)` outside the LightningModule's forward."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        x = dataset().tensors[0][:4]
        with torch.inference_mode():
            self.inference = pl_module.net(x).clone()
        with torch.no_grad():
            self.no_grad = pl_module.net(x)
        self.grad_shape = tuple(pl_module.net(x).shape)  # under grad, no backward


def _fit_with_sampling_callback(rank: int, world_size: int) -> dict[str, Any]:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP()
    callback = SampleInnerModel()
    trainer(ZeRO3Strategy(), world_size, max_steps=3, callbacks=[callback]).fit(model, loader(world_size))
    return {
        "inference": callback.inference,
        "no_grad": callback.no_grad,
        "grad_shape": callback.grad_shape,
        "state": whole_state(model),
    }


def test_callback_calling_the_inner_model_sees_whole_weights_and_training_stays_exact() -> None:
    results = run_ranks(_fit_with_sampling_callback, 2)
    torch.manual_seed(0)
    reference = LitMLP()
    with torch.no_grad():
        expected = reference.net(dataset().tensors[0][:4])
    reference_fit(reference, max_steps=3)
    for result in results:
        assert float((result["inference"] - expected).abs().max()) < 1e-6, "inference_mode call differs"
        assert float((result["no_grad"] - expected).abs().max()) < 1e-6, "no_grad call differs"
        assert result["grad_shape"] == tuple(expected.shape)
        assert max_difference(result["state"], reference.state_dict()) < 1e-5, "training differs from the reference"
