"""Under the Trainer: a callback that calls the inner model directly, under inference_mode,
no_grad and grad, before training; training afterwards equals the single-process reference.
2 ranks started by the strategy's launcher (tests/support/adapted.py `launched`)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, dataset, loader, max_difference, reference_fit, trainer


class SampleInnerModel(pl.Callback):
    """What a sampling callback does: `pl_module.net(x)` outside the LightningModule's forward."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        x = dataset().tensors[0][:4]
        with torch.inference_mode():
            pl_module.inference = pl_module.net(x).clone()
        with torch.no_grad():
            pl_module.no_grad = pl_module.net(x)
        pl_module.grad_shape = tuple(pl_module.net(x).shape)  # under grad, no backward


@pytest.mark.slow
def test_callback_calling_the_inner_model_sees_whole_weights_and_training_stays_exact() -> None:
    torch.manual_seed(0)
    model = LitMLP()
    seen = HandsBack(**{name: f"lightning_module.{name}" for name in ("inference", "no_grad", "grad_shape")})
    fit = trainer(launched("zero3"), 2, max_steps=3, callbacks=[SampleInnerModel(), seen])
    fit.fit(model, loader(2))
    torch.manual_seed(0)
    reference = LitMLP()
    with torch.no_grad():
        expected = reference.net(dataset().tensors[0][:4])
    reference_fit(reference, max_steps=3)
    for rank in range(2):
        assert float((fit.callback_metrics["inference"][rank] - expected).abs().max()) < 1e-6, "inference_mode call"
        assert float((fit.callback_metrics["no_grad"][rank] - expected).abs().max()) < 1e-6, "no_grad call differs"
        assert fit.callback_metrics["grad_shape"][rank] == tuple(expected.shape)
    assert max_difference(model.state_dict(), reference.state_dict()) < 1e-5, "training differs from the reference"
