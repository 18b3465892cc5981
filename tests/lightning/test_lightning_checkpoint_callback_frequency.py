"""Lightning's tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py, adapted with the
strategy as a parameter (2 CPU ranks; Lightning's DDP tests need 2 GPUs). Lightning counts
`torch.save` calls as checkpoints; zero3 also calls it inside DCP once per tensor chunk (by
design, docs/checkpoints.md), so here a checkpoint is counted as a call of the strategy's
`save_checkpoint`, and the `torch.save` calls outside DCP are counted too."""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.pytorch import callbacks
from lightning.pytorch.demos.boring_classes import BoringModel

from tests.support.adapted import STRATEGIES, is_checkpoint, launched, lightning_trainer, on_ranks


class LogsPerRank(BoringModel):
    """Lightning's TestModel of `test_top_k_ddp`: logs a value that differs per rank, and checks
    `strategy.broadcast` of mixed objects."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("my_loss", batch_idx * (1 + self.global_rank), on_epoch=True)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        data = str(self.global_rank)
        out = self.trainer.strategy.broadcast([[data], (data,), set(data)])
        assert out == [["0"], ("0",), set("0")]


def _count_saves(rank: int, strategy: str, root: str, k: int, epochs: int, val_check_interval: float) -> dict[str, Any]:
    checkpoint = callbacks.ModelCheckpoint(dirpath=root, monitor="my_loss_step", save_top_k=k, mode="max")
    trainer = lightning_trainer(
        strategy, root, callbacks=[checkpoint], max_epochs=epochs, val_check_interval=val_check_interval,
        limit_train_batches=10, limit_val_batches=1,
    )  # fmt: skip
    with (
        mock.patch.object(type(trainer.strategy), "save_checkpoint", autospec=True,
                          side_effect=type(trainer.strategy).save_checkpoint) as save,
        mock.patch("torch.save", wraps=torch.save) as torch_save,
    ):  # fmt: skip
        trainer.fit(LogsPerRank())
    # DCP writes each tensor chunk with torch.save(tensor): anything else is a checkpoint file.
    whole_file_saves = [c for c in torch_save.call_args_list if not isinstance(c.args[0], torch.Tensor)]
    return {"checkpoints": save.call_count, "torch_save": len(whole_file_saves), "kept": sorted(os.listdir(root))}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("k", "epochs", "val_check_interval", "expected"), [(2, 2, 0.3, 4)])
def test_top_k_ddp(strategy: str, k: int, epochs: int, val_check_interval: float, expected: int, tmp_path) -> None:
    """Adapted from `test_top_k_ddp[2-2-0.3-4]` (2 GPUs there; 64 batches, here 10 per epoch): how
    many checkpoints top-k saves, on every rank, and which it keeps. On the harness's ranks, not
    the launcher's: it counts each rank's saves (rank 1 must write no file), which the launcher
    does not hand back."""
    results = on_ranks(_count_saves, strategy, str(tmp_path), k, epochs, val_check_interval)
    for rank, result in enumerate(results):
        assert result["checkpoints"] == expected
        # One torch.save per checkpoint, on rank 0 only: DDP's whole file, zero3's trainer_state.pt.
        assert result["torch_save"] == (expected if rank == 0 else 0)
        assert len(result["kept"]) == k
    assert all(is_checkpoint(tmp_path / name, strategy) for name in results[0]["kept"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_checkpoint_ddp_monitor_none(strategy: str, tmp_path) -> None:
    """Adapted from `test_model_checkpoint_ddp_monitor_none` (2 GPUs there), started by the
    strategy's launcher: rank 0's best path is handed back."""
    checkpoint = callbacks.ModelCheckpoint(dirpath=tmp_path, monitor=None, save_top_k=1)
    trainer = lightning_trainer(launched(strategy), tmp_path, callbacks=[checkpoint], max_epochs=1,
                                limit_train_batches=2, limit_val_batches=0)  # fmt: skip
    trainer.fit(BoringModel())
    assert checkpoint.best_model_path == str(tmp_path / "epoch=0-step=2.ckpt")
    assert is_checkpoint(checkpoint.best_model_path, strategy)
