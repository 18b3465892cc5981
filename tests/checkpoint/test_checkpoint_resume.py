"""`trainer.fit(model, ckpt_path=...)` under zero3 continues exactly where the saved run was: the
resumed epoch's losses equal those of an uninterrupted single-process run, whatever the kind of
checkpoint (sharded, full, Lightning DDP's) and the world sizes that wrote and read it. Every run's
ranks are started by the strategy's launcher (tests/support/adapted.py `launched`)."""

from __future__ import annotations

import dataclasses
import os
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero3 import consolidate_checkpoint
from lightning_zero3.checkpoint import CheckpointError
from lightning_zero3.checkpoint.full import read_full_file
from tests.support.adapted import HandsBack, SavesAfterFit, launched
from tests.support.lit import LitMLP, loader, max_difference, reference_fit, trainer

TOL = 1e-5
STEPS_PER_EPOCH = 4


class _SavesBothKinds(pl.Callback):
    """After `fit`, at rest (its `on_fit_end`, the strategy torn down): sharded.ckpt and full.ckpt."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(os.path.join(self.directory, "sharded.ckpt"))
        options = trainer.strategy.lightning_options
        trainer.strategy.lightning_options = dataclasses.replace(options, state_dict_type="full")
        trainer.save_checkpoint(os.path.join(self.directory, "full.ckpt"))


def _fit_one_epoch_and_save(world_size: int, directory: str) -> None:
    """One epoch with a ModelCheckpoint (sharded, written during fit), then both kinds saved after
    fit, at rest."""
    torch.manual_seed(0)
    model = LitMLP()
    callbacks = [ModelCheckpoint(dirpath=directory, filename="during_fit"), _SavesBothKinds(directory)]
    t = trainer(launched("zero3"), world_size, max_epochs=1, enable_checkpointing=True, callbacks=callbacks)
    t.fit(model, loader(world_size))


def _resume(world_size: int, path: str | Path, strategy: str = "zero3") -> list[tuple[list[float], dict]]:
    """Each rank's losses of the resumed epoch, with the whole weights the launcher handed back."""
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = LitMLP()
    t = trainer(
        launched(strategy), world_size, max_epochs=2, callbacks=[HandsBack(losses="lightning_module.step_losses")]
    )
    t.fit(model, loader(world_size), ckpt_path=path)
    assert len(t.callback_metrics["losses"]) == world_size
    return [(losses, model.state_dict()) for losses in t.callback_metrics["losses"]]


@pytest.fixture(scope="module")
def saved_at(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """saved_at(world_size) -> directory with during_fit.ckpt, sharded.ckpt and full.ckpt."""
    cache: dict[int, Path] = {}

    def get(world_size: int) -> Path:
        if world_size not in cache:
            directory = tmp_path_factory.mktemp(f"saved_at_{world_size}")
            _fit_one_epoch_and_save(world_size, str(directory))
            cache[world_size] = directory
        return cache[world_size]

    return get


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = LitMLP()
    losses = reference_fit(model, epochs=2)
    return losses, model.state_dict()


def _assert_continues_uninterrupted(results: list[tuple[list[float], dict]], uninterrupted: Any) -> None:
    losses, state = uninterrupted
    for step_losses, final_state in results:
        assert len(step_losses) == STEPS_PER_EPOCH  # only the second epoch ran
        assert max(abs(a - b) for a, b in zip(step_losses, losses[STEPS_PER_EPOCH:])) < TOL
        assert max_difference(final_state, state) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("resume_world_size", [1, 2, 3])
def test_sharded_checkpoint_from_model_checkpoint_resumes_at_1_2_and_3_ranks(
    saved_at, uninterrupted, resume_world_size
):
    path = saved_at(2) / "during_fit.ckpt"
    assert (path / "meta.json").is_file()
    _assert_continues_uninterrupted(_resume(resume_world_size, path), uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.parametrize("saved_world_size", [1, 3])
def test_checkpoint_saved_at_1_or_3_ranks_resumes_at_2(saved_at, uninterrupted, saved_world_size, kind):
    path = saved_at(saved_world_size) / f"{kind}.ckpt"
    _assert_continues_uninterrupted(_resume(2, path), uninterrupted)


def test_full_checkpoint_resumes_at_the_same_world_size(saved_at, uninterrupted):
    _assert_continues_uninterrupted(_resume(2, saved_at(2) / "full.ckpt"), uninterrupted)


def test_sharded_checkpoint_saved_after_fit_equals_the_one_saved_during_fit(saved_at, tmp_path):
    files = {}
    for name in ("during_fit", "sharded"):
        files[name] = torch.load(consolidate_checkpoint(saved_at(2) / f"{name}.ckpt", tmp_path / name).dst)
    assert max_difference(files["during_fit"]["state_dict"], files["sharded"]["state_dict"]) == 0
    during, after = (files[n]["optimizer_states"][0] for n in ("during_fit", "sharded"))
    assert during["param_groups"] == after["param_groups"]
    for index, entry in after["state"].items():
        for key, value in entry.items():
            assert torch.equal(during["state"][index][key], value)


def test_consolidated_sharded_checkpoint_equals_the_full_checkpoint(saved_at, tmp_path):
    full = torch.load(saved_at(2) / "full.ckpt", weights_only=True)
    consolidated = torch.load(consolidate_checkpoint(saved_at(2) / "sharded.ckpt", tmp_path / "c.ckpt").dst)
    assert list(consolidated) == list(full)  # the same Lightning keys, in the same order
    assert list(consolidated["state_dict"]) == list(full["state_dict"])
    assert max_difference(consolidated["state_dict"], full["state_dict"]) == 0
    for key in ("epoch", "global_step", "loops", "lr_schedulers", "callbacks", "pytorch-lightning_version"):
        assert consolidated[key] == full[key], key
    optim, full_optim = consolidated["optimizer_states"][0], full["optimizer_states"][0]
    assert optim["param_groups"] == full_optim["param_groups"]
    for index, entry in full_optim["state"].items():
        for key, value in entry.items():
            assert torch.equal(optim["state"][index][key], value), (index, key)


@pytest.mark.slow
def test_full_and_consolidated_checkpoints_load_without_lightning_zero3(saved_at, tmp_path):
    """Plain torch.load (weights_only) and LightningModule.load_from_checkpoint read them, and
    nothing in the pickle refers to lightning_zero3."""
    torch.manual_seed(0)
    reference = LitMLP()
    reference_fit(reference, epochs=1)
    consolidated = consolidate_checkpoint(saved_at(2) / "sharded.ckpt", tmp_path / "consolidated.ckpt").dst
    for path in (saved_at(2) / "full.ckpt", consolidated):
        with zipfile.ZipFile(path) as archive:
            pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
        assert b"lightning_zero3" not in pickled
        assert torch.load(path, weights_only=True)["state_dict"]["net.head.weight"].shape == (5, 13)
        model = LitMLP.load_from_checkpoint(path)
        assert max_difference(model.state_dict(), reference.state_dict()) < TOL


@pytest.mark.slow
def test_validate_with_a_sharded_checkpoint_uses_its_weights(saved_at):
    torch.manual_seed(0)
    reference = LitMLP()
    reference_fit(reference, epochs=1)
    x, y = loader(1).dataset.tensors
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(reference(x), y))
    torch.manual_seed(1)
    validate = trainer(launched("zero3"), 3, callbacks=[HandsBack(val_loss="callback_metrics.val_loss")])
    validate.validate(LitMLP(), loader(3), ckpt_path=saved_at(2) / "sharded.ckpt")
    assert len(validate.callback_metrics["val_loss"]) == 3
    for val_loss in validate.callback_metrics["val_loss"]:
        assert abs(val_loss - expected) < TOL


@pytest.fixture(scope="module")
def saved_by_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ddp")
    torch.manual_seed(0)
    model = LitMLP()
    trainer(launched("ddp"), 2, max_epochs=1, callbacks=[SavesAfterFit(directory / "ddp.ckpt")]).fit(model, loader(2))
    torch.save(model.state_dict(), directory / "weights.pt")  # the weights DDP's launcher handed back
    return directory


@pytest.mark.slow
def test_ddp_checkpoint_resumes_under_zero3_at_another_world_size(saved_by_ddp, uninterrupted):
    _assert_continues_uninterrupted(_resume(3, saved_by_ddp / "ddp.ckpt"), uninterrupted)


@pytest.mark.slow
def test_plain_state_dict_file_fine_tunes_under_zero3(saved_by_ddp):
    weights = saved_by_ddp / "weights.pt"
    reference = LitMLP()
    reference.load_state_dict(torch.load(weights, weights_only=True))
    expected = reference_fit(reference, epochs=1)  # a fresh optimizer from the loaded weights
    model = LitMLP()
    model.load_state_dict(torch.load(weights, weights_only=True))  # before fit: sharding starts from it
    fine_tune = trainer(
        launched("zero3"), 2, max_epochs=1, callbacks=[HandsBack(losses="lightning_module.step_losses")]
    )
    fine_tune.fit(model, loader(2))
    for losses in fine_tune.callback_metrics["losses"]:
        assert len(losses) == len(expected)
        assert max(abs(a - b) for a, b in zip(losses, expected)) < TOL


def test_plain_state_dict_as_ckpt_path_says_how_to_fine_tune(saved_by_ddp):
    with pytest.raises(CheckpointError, match="plain state dict.*load it into the model before fit"):
        read_full_file(saved_by_ddp / "weights.pt", trusted=False)


@pytest.mark.parametrize("saved, returned", [(2, 1), (1, 2)])
def test_a_full_checkpoint_of_another_number_of_optimizers_is_refused_before_any_loads(saved, returned):
    """One process: a full checkpoint's "optimizer_states" hold `saved` optimizers, the run
    configured `returned`: a CheckpointError naming both counts, and no optimizer changed."""
    from lightning_zero3.common.options import LightningOptions
    from lightning_zero3.common.run import ShardedRun
    from lightning_zero3.engine import ShardedModel
    from tests.support.models import MLP

    model = MLP()
    run = ShardedRun(ShardedModel(model), lambda: LightningOptions(state_dict_type="full"))
    trained = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 7)).sum().backward()
    trained.step()
    fresh = [torch.optim.Adam(model.parameters()) for _ in range(returned)]
    with pytest.raises(CheckpointError, match=f"state for {saved} optimizers but `configure_optimizers` returned "
                                              f"{returned}; resume with the same optimizers"):  # fmt: skip
        run.load_optimizer_states([run.optimizer_state(trained)] * saved, fresh)
    assert all(not optimizer.state for optimizer in fresh)
