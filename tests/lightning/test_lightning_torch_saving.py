"""Lightning's tests_pytorch/checkpointing/test_torch_saving.py, adapted with the strategy as a
parameter (2 CPU ranks started by the strategy's launcher, as there): after `fit`, the weights
handed back to the test process are trained, and `torch.save` of the model and of the whole
Trainer works and the Trainer loads back. (Inside a zero3 rank the module stays sharded after
`fit`, as under Lightning's FSDP, so a rank's Trainer does not pickle; the test process's does.)"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from tests.support.adapted import STRATEGIES, launched, lightning_trainer


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_torch_save_ddp_cpu(strategy: str, tmp_path) -> None:
    """Adapted from `test_model_torch_save_ddp_cpu` (ddp_spawn, 2 CPU devices), with the load back
    of `test_model_torch_save` (one process) added."""
    model = BoringModel()
    before = model.layer.weight.clone()
    trainer = lightning_trainer(launched(strategy), tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(model)
    assert model.layer.weight.shape == (2, 32) and not torch.equal(model.layer.weight, before)
    path = tmp_path / "temp.pt"
    torch.save(trainer.model, path)
    assert type(torch.load(path, weights_only=False)).__name__ == "BoringModel"
    torch.save(trainer, path)
    loaded = torch.load(path, weights_only=False)
    assert type(loaded.strategy) is type(trainer.strategy)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.lightning_module.parameters()))
