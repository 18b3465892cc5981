"""Lightning's tests_pytorch/checkpointing/test_torch_saving.py, adapted with the strategy as a
parameter (2 gloo CPU ranks): after `fit`, `torch.save` of the model and of the whole Trainer works
and the Trainer loads back. Under zero3 the module stays sharded after `fit` (its hooks hold the
engine's process groups, as under Lightning's FSDP), so a rank's Trainer does not pickle; the test
runs for zero3 as Lightning runs it, under the spawn launcher, whose parent process gets the whole
weights (tests/test_lightning_launchers.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from tests.adapted import STRATEGIES, lightning_trainer, on_ranks


def _fit_and_torch_save(rank: int, strategy: str, root: str) -> dict[str, Any]:
    model = BoringModel()
    trainer = lightning_trainer(strategy, root, max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(model)
    path = f"{root}/temp-{rank}.pt"
    torch.save(trainer.model, path)
    saved_model = torch.load(path, weights_only=False)
    torch.save(trainer, path)
    loaded = torch.load(path, weights_only=False)
    return {
        "model": type(saved_model).__name__,
        "strategy": type(loaded.strategy).__name__,
        "weights_equal": all(
            torch.equal(a, b) for a, b in zip(model.parameters(), loaded.lightning_module.parameters())
        ),
        "weight_shape": tuple(loaded.lightning_module.layer.weight.shape),
    }


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "zero3"])
def test_model_torch_save_ddp_cpu(strategy: str, tmp_path) -> None:
    """Adapted from `test_model_torch_save_ddp_cpu` (ddp_spawn, 2 CPU devices), with the load back
    of `test_model_torch_save` (one process) added."""
    expected_strategy = {"ddp": "DDPStrategy"}[strategy]
    for result in on_ranks(_fit_and_torch_save, strategy, str(tmp_path)):
        assert result["strategy"] == expected_strategy
        assert result["weight_shape"] == (2, 32) and result["weights_equal"]
        assert result["model"] in ("DistributedDataParallel", "BoringModel")
