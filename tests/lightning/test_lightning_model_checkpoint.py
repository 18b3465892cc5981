"""Lightning's tests_pytorch/checkpointing/test_model_checkpoint.py, adapted with the strategy as a
parameter (2 CPU ranks started by the strategy's launcher): what ModelCheckpoint writes, links,
keeps and removes, what a checkpoint saved on an exception holds, and fitting/testing again from a
checkpoint. By design zero3's checkpoints are directories (tests/support/adapted.py reads them); their
names and the files ModelCheckpoint keeps are DDP's. `test_model_checkpoint_no_extraneous_invocations`
is adapted for zero3 in tests/checkpoint/test_checkpoint_plain.py."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from tests.support.adapted import (
    STRATEGIES,
    hand_back,
    is_checkpoint,
    launched,
    lightning_trainer,
    load_module,
    on_ranks,
    read_checkpoint,
)


class LogInTwoMethods(BoringModel):
    """Lightning's LogInTwoMethods: logs the training loss as "early_stop_on"."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("early_stop_on", out["loss"])
        return out

    def on_validation_epoch_end(self) -> None:
        self.log("val_acc", torch.tensor(1.23))


class LastLink(ModelCheckpoint):
    """Hands back from rank 0 where its last checkpoint went (the launcher hands back only the best)."""

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        hand_back(trainer, last_model_path=self.last_model_path, last_saved=self._last_checkpoint_saved)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_checkpoint_save_last_link(strategy: str, tmp_path) -> None:
    """Adapted from `test_model_checkpoint_save_last[link]` (one process there, 10 batches per
    epoch): one last checkpoint (named by its epoch), a relative link to the newest top-k checkpoint (a directory
    under zero3)."""
    checkpoint = LastLink(monitor="early_stop_on", dirpath=tmp_path, save_top_k=-1, save_last="link")
    checkpoint.CHECKPOINT_NAME_LAST = "last-{epoch}"
    trainer = lightning_trainer(launched(strategy), tmp_path, callbacks=[checkpoint], max_epochs=3,
                                limit_train_batches=2, limit_val_batches=1)  # fmt: skip
    trainer.fit(LogInTwoMethods())
    last = tmp_path / "last-epoch=2.ckpt"
    assert trainer.callback_metrics["last_model_path"] == str(last)
    assert os.path.realpath(last) == trainer.callback_metrics["last_saved"]
    assert set(os.listdir(tmp_path)) == {f"epoch={i}-step={2 * (i + 1)}.ckpt" for i in range(3)} | {last.name}
    assert os.path.islink(last) and not os.path.isabs(os.readlink(last))
    assert is_checkpoint(os.path.realpath(last), strategy) and is_checkpoint(tmp_path / "epoch=0-step=2.ckpt", strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_checkpoint_save_last_checkpoint_contents(strategy: str, tmp_path) -> None:
    """Adapted from `test_model_checkpoint_save_last_checkpoint_contents` (one process there):
    save_last=True writes a checkpoint of its own (not a link) that holds what the last epoch's
    checkpoint holds."""
    checkpoint = LastLink(monitor="early_stop_on", dirpath=tmp_path, filename="{epoch}", save_top_k=3, save_last=True)
    trainer = lightning_trainer(launched(strategy), tmp_path, callbacks=[checkpoint], max_epochs=3,
                                limit_train_batches=2, limit_val_batches=1)  # fmt: skip
    trainer.fit(LogInTwoMethods())
    assert trainer.callback_metrics["last_model_path"] == f"{tmp_path}/last.ckpt"
    last_epoch, last = tmp_path / "epoch=2.ckpt", tmp_path / "last.ckpt"
    assert is_checkpoint(last_epoch, strategy) and is_checkpoint(last, strategy) and not os.path.islink(last)
    a, b = read_checkpoint(last_epoch), read_checkpoint(last)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"]) == (2, 6)
    assert a["callbacks"][checkpoint.state_key] == b["callbacks"][checkpoint.state_key]
    model_last_epoch, model_last = load_module(LogInTwoMethods, last_epoch), load_module(LogInTwoMethods, last)
    for w0, w1 in zip(model_last_epoch.parameters(), model_last.parameters()):
        assert torch.equal(w0, w1)


class RaisesInTrainingStep(BoringModel):
    """Lightning's TroubledModelInTrainingStep, raising in the second epoch (after a step)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.current_epoch == 1 and batch_idx == 1:
            raise RuntimeError("Trouble!")
        return super().training_step(batch, batch_idx)


class RaisesOnAfterBackward(BoringModel):
    """Lightning's TroubledModelOnAfterBackward: between backward and the optimizer step."""

    def on_after_backward(self) -> None:
        if self.current_epoch == 1:
            raise RuntimeError("Trouble!")


class RaisesOnFitEnd(BoringModel):
    """Lightning's TroubledModelOnFitEnd: after the strategy's teardown."""

    def on_fit_end(self) -> None:
        raise RuntimeError("Trouble!")


TROUBLED = {"training_step": RaisesInTrainingStep, "on_after_backward": RaisesOnAfterBackward,
            "on_fit_end": RaisesOnFitEnd}  # fmt: skip


def _save_on_exception(rank: int, strategy: str, root: str, troubled: str) -> None:
    checkpoint = ModelCheckpoint(dirpath=root, filename="exception", save_on_exception=True, every_n_epochs=7)
    trainer = lightning_trainer(strategy, root, callbacks=[checkpoint], max_epochs=2, limit_train_batches=2,
                                limit_val_batches=1)  # fmt: skip
    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(TROUBLED[troubled]())


@pytest.mark.parametrize(
    ("strategy", "troubled"),
    [("ddp", "training_step"), *(("zero3", troubled) for troubled in TROUBLED)],
)
def test_model_checkpoint_on_exception_parametrized(strategy: str, troubled: str, tmp_path) -> None:
    """Adapted from `test_model_checkpoint_on_exception_parametrized` (one process there; 3 of its
    24 places to raise, the ones where zero3's state differs: inside forward, between backward and
    step, after teardown; DDP runs the first): the checkpoint saved on the exception holds the
    whole model. On the harness's ranks: under Lightning's multiprocessing launcher, `on_exception`
    runs in the test process (`_call_and_handle_interrupt`), not in the ranks, so nothing is saved
    there on an exception."""
    on_ranks(_save_on_exception, strategy, str(tmp_path), troubled)
    path = tmp_path / "exception.ckpt"
    assert is_checkpoint(path, strategy)
    state = read_checkpoint(path)["state_dict"]
    assert state.keys() == {"layer.weight", "layer.bias"} and state["layer.weight"].shape == (2, 32)


class ValLossModel(BoringModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step(batch), sync_dist=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_repeated_strategy(strategy: str, tmp_path) -> None:
    """Adapted from `test_checkpoint_repeated_strategy` (one process there, 4 repetitions): fit
    and test again from the best checkpoint leave the directory as it was."""
    checkpoint = ModelCheckpoint(monitor="val_loss", dirpath=tmp_path, filename="{epoch:02d}")
    options = dict(max_epochs=1, limit_train_batches=2, limit_val_batches=2, limit_test_batches=2)
    model = ValLossModel()
    lightning_trainer(launched(strategy), tmp_path, callbacks=[checkpoint], **options).fit(model)
    assert set(os.listdir(tmp_path)) == {"epoch=00.ckpt"}
    trainer = lightning_trainer(launched(strategy), tmp_path, enable_checkpointing=False, **options)
    trainer.fit(model, ckpt_path=checkpoint.best_model_path)
    trainer.test(ckpt_path=checkpoint.best_model_path, verbose=False)
    assert set(os.listdir(tmp_path)) == {"epoch=00.ckpt"}
    assert is_checkpoint(tmp_path / "epoch=00.ckpt", strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_and_old_checkpoint_files_remain(strategy: str, tmp_path) -> None:
    """Adapted from `test_resume_and_old_checkpoint_files_remain[True]` (one process there): top-k
    removal keeps the checkpoint the fit resumed from."""
    options = dict(limit_train_batches=10, limit_val_batches=0)
    model, first = BoringModel(), tmp_path / "first"

    def callback() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=first, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2)

    lightning_trainer(launched(strategy), tmp_path, callbacks=callback(), max_steps=5, **options).fit(model)
    assert set(os.listdir(first)) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"}
    trainer = lightning_trainer(launched(strategy), tmp_path, callbacks=callback(), max_steps=8, **options)
    trainer.fit(model, ckpt_path=first / "epoch=0-step=4.ckpt")
    assert set(os.listdir(first)) == {"epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"}
    assert is_checkpoint(tmp_path / "first" / "epoch=0-step=4.ckpt", strategy)
