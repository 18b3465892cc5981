"""Lightning's tests_pytorch/callbacks/test_pruning.py, adapted with the strategy as a parameter (2
CPU ranks started by the strategy's launcher, as there). DDP prunes as Lightning's test does; zero3
refuses ModelPruning at setup with the message of lightning_zero3/tools/callbacks.py (torch.nn.utils.prune
would replace the parameters the engine has sharded)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelPruning
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from tests.support.adapted import STRATEGIES, launched, lightning_trainer


class PruningModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(
            OrderedDict(
                [
                    ("mlp_1", nn.Linear(32, 32)),
                    ("mlp_2", nn.Linear(32, 32, bias=False)),
                    ("mlp_3", nn.Linear(32, 2)),
                ]
            )
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pruning_callback_ddp_cpu(strategy: str, tmp_path) -> None:
    """Adapted from `test_pruning_callback_ddp_cpu` (parameters_to_prune=True on ddp_spawn, 2 CPU
    devices), with 2 epochs of 2 batches; it also checks what the original leaves out under a
    strategy: that the weights handed back from rank 0 were pruned."""
    seed_everything(1)
    model = PruningModel()
    assert torch.all(model.layer.mlp_2.weight != 0)
    to_prune = [(model.layer.mlp_1, "weight"), (model.layer.mlp_2, "weight")]
    pruning = ModelPruning("l1_unstructured", amount=0.3, parameters_to_prune=to_prune)
    trainer = lightning_trainer(
        launched(strategy), tmp_path, max_epochs=2, limit_train_batches=2, limit_val_batches=1, limit_test_batches=1,
        callbacks=[pruning], enable_checkpointing=False,
    )  # fmt: skip
    if strategy == "zero3":
        refusal = "ModelPruning is not supported by ZeRO3Strategy: torch.nn.utils.prune"
        with pytest.raises(Exception, match=refusal) as err:
            trainer.fit(model)
        assert "docs/user-guide.md" in str(err.value)
        return
    trainer.fit(model)
    trainer.test(model)
    # amount=0.3 pruned at the end of each of 2 epochs: 1 - 0.7 ** 2 of the weights.
    weight = model.layer.mlp_2.weight
    assert weight.shape == (32, 32) and abs(float((weight == 0).float().mean()) - 0.51) < 0.01
