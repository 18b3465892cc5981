"""Lightning's tests_pytorch/models/test_restore.py, adapted with the strategy as a parameter (2
CPU ranks; on the harness's gloo ranks where a test reads each rank's state, as each says):
resuming from `ModelCheckpoint`'s and `trainer.save_checkpoint`'s checkpoints, fitting twice,
restarting after an exception, and loading a trained module in one process. By design zero3's
checkpoint is a directory: it is read with `lightning_zero3.load_checkpoint` /
`load_from_checkpoint` where Lightning's tests call `torch.load` / `Model.load_from_checkpoint`
(tests/support/adapted.py). `test_running_test_pretrained_model_distrib_ddp_spawn` is adapted for zero3 in
tests/checkpoint/test_checkpoint_plain.py. On the harness's ranks: `resumed` (two fits in one process, the
save after fit in the ranks, where the fit's loop state is; each rank's resumed start state),
`test_fit_twice` (one Trainer, two fits) and `test_restarting_mid_epoch_raises_warning` (a failed
fit, then a save and a fit in the same process; which rank warned)."""

from __future__ import annotations

import copy
import glob
import os
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from tests.support.adapted import (
    STRATEGIES,
    is_checkpoint,
    launched,
    lightning_trainer,
    load_module,
    on_ranks,
    read_checkpoint,
)
from tests.support.lit import whole_state

EPOCHS, BATCHES = 2, 2
CHECKPOINT_STATE = ("best_model_path", "best_model_score", "best_k_models", "kth_best_model_path", "last_model_path")
BATCH = torch.linspace(-1, 1, 4 * 32).reshape(4, 32)


class ValLossModel(BoringModel):
    """Lightning's ValTestLossBoringModel: saves its hyper-parameters, logs val_loss."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"], sync_dist=True)
        return out


class PropertyParity(Callback):
    """Lightning's ModelTrainerPropertyParity: trainer and module agree on epoch and step."""

    def _check(self, trainer: Any, pl_module: Any, *_: Any) -> None:
        assert trainer.global_step == pl_module.global_step and trainer.current_epoch == pl_module.current_epoch

    on_train_start = on_train_batch_start = on_train_batch_end = on_train_end = _check


class RestoredState(Callback):
    """Records what a resumed fit starts from (test_correct_step_and_epoch,
    test_callbacks_state_fit_ckpt_path)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        checkpoint = trainer.checkpoint_callback
        self.start = {
            "epoch": trainer.current_epoch,
            "step": trainer.global_step,
            "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "checkpoint": {k: copy.deepcopy(getattr(checkpoint, k)) for k in CHECKPOINT_STATE},
        }


def _fit_save_and_resume(rank: int, strategy: str, root: str) -> dict[str, Any]:
    model = ValLossModel()
    checkpoint = ModelCheckpoint(dirpath=f"{root}/ckpts", monitor="val_loss", save_top_k=-1, save_last=True)
    options = dict(max_epochs=EPOCHS, limit_train_batches=BATCHES, limit_val_batches=2, num_sanity_val_steps=0)
    trainer = lightning_trainer(strategy, root, callbacks=[checkpoint, PropertyParity()], **options)
    trainer.fit(model)
    trainer.save_checkpoint(f"{root}/model.ckpt")  # after fit: epoch and step already advanced
    model.eval()
    with torch.no_grad():
        predictions = model(BATCH)
    first = whole_state(model)
    saved = {k: copy.deepcopy(getattr(checkpoint, k)) for k in CHECKPOINT_STATE}
    restored = RestoredState()
    resumed_checkpoint = ModelCheckpoint(dirpath=f"{root}/ckpts", monitor="val_loss", save_top_k=-1, save_last=True)
    options["max_epochs"] = 2 * EPOCHS
    trainer = lightning_trainer(strategy, root, callbacks=[resumed_checkpoint, PropertyParity(), restored], **options)
    trainer.fit(model, ckpt_path=f"{root}/model.ckpt")
    return {
        "first": first,
        "final": whole_state(model),
        "predictions": predictions,
        "saved_checkpoint_state": saved,
        "start": restored.start,
        "end": (trainer.current_epoch, trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped),
    }


@pytest.fixture(scope="module", params=STRATEGIES)
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank fit with ModelCheckpoint, `trainer.save_checkpoint` after it, and a resumed fit.
    On the harness's ranks: `trainer.save_checkpoint` after fit must run where the fit's loop
    state is (the ranks; the test process's Trainer is at step 0 under the launcher), and the
    tests read the state each rank's resumed fit starts from (loops, scheduler, ModelCheckpoint)."""
    root = tmp_path_factory.mktemp(request.param)
    results = on_ranks(_fit_save_and_resume, request.param, str(root))
    return {"strategy": request.param, "root": root, **results[0], "ranks": results}


@pytest.mark.slow
def test_correct_step_and_epoch(resumed: dict[str, Any]) -> None:
    """Adapted from `test_correct_step_and_epoch` and `test_model_properties_fit_ckpt_path` (one
    process there): a checkpoint saved after fit holds the advanced epoch and step, and the fit
    resumed from it starts and ends there (PropertyParity checks every batch on every rank)."""
    path = resumed["root"] / "model.ckpt"
    assert is_checkpoint(path, resumed["strategy"])
    checkpoint = read_checkpoint(path)
    assert checkpoint["epoch"] == EPOCHS and checkpoint["global_step"] == EPOCHS * BATCHES
    for rank in resumed["ranks"]:
        start = rank["start"]
        assert (start["epoch"], start["step"], start["batches_that_stepped"]) == (EPOCHS, 4, 4)
        assert start["scheduler"] == checkpoint["lr_schedulers"][0]
        assert rank["end"] == (2 * EPOCHS, 2 * EPOCHS * BATCHES, 2 * EPOCHS * BATCHES)


def test_callbacks_state_fit_ckpt_path(resumed: dict[str, Any]) -> None:
    """Adapted from `test_callbacks_state_fit_ckpt_path` (one process there): a resumed fit
    restores ModelCheckpoint's best and last paths and its top-k."""
    for rank in resumed["ranks"]:
        assert rank["start"]["checkpoint"] == rank["saved_checkpoint_state"]
        assert rank["start"]["checkpoint"]["last_model_path"].endswith("last.ckpt")


def test_load_model_from_checkpoint(resumed: dict[str, Any]) -> None:
    """Adapted from `test_load_model_from_checkpoint` (one process there): the last checkpoint
    (of the resumed fit) holds hyper-parameters, and the module loaded from it in this process
    has the trained weights."""
    last = sorted(glob.glob(os.path.join(resumed["root"], "ckpts", "*.ckpt")))[-1]
    assert os.path.basename(last) == "last.ckpt" and is_checkpoint(last, resumed["strategy"])
    assert "hyper_parameters" in read_checkpoint(last)
    pretrained = load_module(ValLossModel, last)
    assert pretrained.hparams.batch_size == 4
    state = pretrained.state_dict()
    assert state.keys() == resumed["final"].keys()
    assert all(torch.equal(state[k], v) for k, v in resumed["final"].items())


def test_model_saving_loading(resumed: dict[str, Any]) -> None:
    """Adapted from `test_model_saving_loading` (one process there): the module loaded from
    `trainer.save_checkpoint`'s checkpoint predicts what the trained module predicted."""
    loaded = load_module(ValLossModel, resumed["root"] / "model.ckpt")
    assert resumed["first"], "nothing to compare"
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in resumed["first"].items())
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(BATCH), resumed["predictions"])


def test_strict_model_load_less_params(resumed: dict[str, Any]) -> None:
    """Adapted from `test_strict_model_load_less_params` (one process there): a module with
    parameters the checkpoint lacks loads with strict=False and is refused, naming them, with
    strict=True."""

    class CurrentModel(ValLossModel):
        def __init__(self, batch_size: int = 4) -> None:
            super().__init__(batch_size)
            self.c_d3 = torch.nn.Linear(7, 7)

    path = resumed["root"] / "model.ckpt"
    load_module(CurrentModel, path, strict=False)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "c_d3.weight", "c_d3.bias"'):
        load_module(CurrentModel, path, strict=True)


class EpochRecorder(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[int] = []

    def on_train_epoch_end(self) -> None:
        self.epochs.append(self.current_epoch)


def _fit_twice(rank: int, strategy: str, root: str) -> list[int]:
    trainer = lightning_trainer(strategy, root, max_epochs=2, limit_train_batches=1, limit_val_batches=1)
    first = EpochRecorder()
    trainer.fit(first)
    trainer.fit_loop.max_epochs = 4
    second = EpochRecorder()
    trainer.fit(second)
    assert tuple(whole_state(second)["layer.weight"].shape) == (2, 32)
    return first.epochs + second.epochs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fit_twice(strategy: str, tmp_path) -> None:
    """Adapted from `test_fit_twice` (one process there): one Trainer, two fits, a new module each.
    On the harness's ranks: the second fit goes on from the first's loop state, which stays in
    the ranks under the launcher (it hands back weights and metrics, not the loops)."""
    assert on_ranks(_fit_twice, strategy, str(tmp_path)) == [[0, 1, 2, 3]] * 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_try_resume_from_non_existing_checkpoint(strategy: str, tmp_path) -> None:
    """Adapted from `test_try_resume_from_non_existing_checkpoint` (one process there), started by
    the strategy's launcher: rank 0's error reaches the test process."""
    trainer = lightning_trainer(launched(strategy), tmp_path)
    with pytest.raises(Exception, match="Checkpoint file not found"):
        trainer.fit(BoringModel(), ckpt_path=f"{tmp_path}/non_existing.ckpt")


class CustomError(Exception):
    pass


class RaisesAtBatch(BoringModel):
    """Lightning's ExceptionModel: raises in `training_step` at `stop_batch_idx`."""

    def __init__(self, stop_batch_idx: int) -> None:
        super().__init__()
        self.stop_batch_idx = stop_batch_idx

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == self.stop_batch_idx:
            raise CustomError()
        return super().training_step(batch, batch_idx)


def _restart_mid_epoch(rank: int, strategy: str, root: str) -> list[str]:
    options = dict(limit_train_batches=4, limit_val_batches=0)
    model = RaisesAtBatch(stop_batch_idx=2)
    trainer = lightning_trainer(strategy, root, max_epochs=1, **options)
    with pytest.raises(CustomError):
        trainer.fit(model)
    trainer.save_checkpoint(f"{root}/resume.ckpt")
    model.stop_batch_idx = -1
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        lightning_trainer(strategy, root, max_epochs=2, **options).fit(model, ckpt_path=f"{root}/resume.ckpt")
    assert tuple(whole_state(model)["layer.weight"].shape) == (2, 32)  # trained on from the checkpoint
    return [str(w.message) for w in warned]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_restarting_mid_epoch_raises_warning(strategy: str, tmp_path) -> None:
    """Adapted from `test_restarting_mid_epoch_raises_warning[ExceptionModel-True]` (one process
    there): after an exception in `training_step`, `trainer.save_checkpoint` saves, and fitting the
    same module from that checkpoint warns (on rank 0, as Lightning's warnings go) that it ended
    mid-epoch. Under zero3 the failed fit leaves the module sharded; the next fit makes it whole
    first (engine/left_sharded.py). On the harness's ranks: it saves from the Trainer of the failed
    fit, in the ranks, and reads which rank warned."""
    rank0, rank1 = on_ranks(_restart_mid_epoch, strategy, str(tmp_path))
    checkpoint = read_checkpoint(tmp_path / "resume.ckpt")
    assert checkpoint["global_step"] == 2 and checkpoint["state_dict"]["layer.weight"].shape == (2, 32)
    assert any("resuming from a checkpoint that ended" in message for message in rank0)
    assert not any("resuming from a checkpoint that ended" in message for message in rank1)
