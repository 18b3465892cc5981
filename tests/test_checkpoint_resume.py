"""`trainer.fit(model, ckpt_path=...)` under zero3 continues exactly where the saved run was: the
resumed epoch's losses equal those of an uninterrupted single-process run, whatever the kind of
checkpoint (sharded, full, Lightning DDP's) and the world sizes that wrote and read it."""

from __future__ import annotations

import dataclasses
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero3 import consolidate_checkpoint
from lightning_zero3.checkpoint import CheckpointError
from lightning_zero3.checkpoint.full import read_full_file
from tests.lit import LitMLP, become_lightning_rank, loader, max_difference, reference_fit, trainer, whole_state
from tests.ranks import run_ranks

TOL = 1e-5
STEPS_PER_EPOCH = 4


def _fit_one_epoch_and_save(rank: int, world_size: int, directory: str) -> None:
    """One epoch with a ModelCheckpoint (sharded, written during fit), then both kinds saved after
    fit, at rest."""
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP()
    callback = ModelCheckpoint(dirpath=directory, filename="during_fit")
    t = trainer(ZeRO3Strategy(), world_size, max_epochs=1, enable_checkpointing=True, callbacks=[callback])
    t.fit(model, loader(world_size))
    t.save_checkpoint(os.path.join(directory, "sharded.ckpt"))
    t.strategy.lightning_options = dataclasses.replace(t.strategy.lightning_options, state_dict_type="full")
    t.save_checkpoint(os.path.join(directory, "full.ckpt"))


def _resume(rank: int, world_size: int, path: str, strategy: str = "zero3") -> tuple[list[float], dict]:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = LitMLP()
    t = trainer(ZeRO3Strategy() if strategy == "zero3" else strategy, world_size, max_epochs=2)
    t.fit(model, loader(world_size), ckpt_path=path)
    return model.step_losses, whole_state(model)


@pytest.fixture(scope="module")
def saved_at(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """saved_at(world_size) -> directory with during_fit.ckpt, sharded.ckpt and full.ckpt."""
    cache: dict[int, Path] = {}

    def get(world_size: int) -> Path:
        if world_size not in cache:
            directory = tmp_path_factory.mktemp(f"saved_at_{world_size}")
            run_ranks(_fit_one_epoch_and_save, world_size, str(directory))
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


@pytest.mark.parametrize("resume_world_size", [1, 2, 3])
def test_sharded_checkpoint_from_model_checkpoint_resumes_at_1_2_and_3_ranks(
    saved_at, uninterrupted, resume_world_size
):
    path = saved_at(2) / "during_fit.ckpt"
    assert (path / "meta.json").is_file()
    _assert_continues_uninterrupted(run_ranks(_resume, resume_world_size, str(path)), uninterrupted)


@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.parametrize("saved_world_size", [1, 3])
def test_checkpoint_saved_at_1_or_3_ranks_resumes_at_2(saved_at, uninterrupted, saved_world_size, kind):
    path = saved_at(saved_world_size) / f"{kind}.ckpt"
    _assert_continues_uninterrupted(run_ranks(_resume, 2, str(path)), uninterrupted)


def test_full_checkpoint_resumes_at_the_same_world_size(saved_at, uninterrupted):
    _assert_continues_uninterrupted(run_ranks(_resume, 2, str(saved_at(2) / "full.ckpt")), uninterrupted)


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


def _validate(rank: int, world_size: int, path: str) -> float:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(1)
    (metrics,) = trainer(ZeRO3Strategy(), world_size).validate(LitMLP(), loader(world_size), ckpt_path=path)
    return metrics["val_loss"]


def test_validate_with_a_sharded_checkpoint_uses_its_weights(saved_at):
    torch.manual_seed(0)
    reference = LitMLP()
    reference_fit(reference, epochs=1)
    x, y = loader(1).dataset.tensors
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(reference(x), y))
    for val_loss in run_ranks(_validate, 3, str(saved_at(2) / "sharded.ckpt")):
        assert abs(val_loss - expected) < TOL


def _ddp_fit_one_epoch_and_save(rank: int, world_size: int, directory: str) -> None:
    become_lightning_rank(rank, world_size)
    torch.manual_seed(0)
    model = LitMLP()
    t = trainer("ddp", world_size, max_epochs=1)
    t.fit(model, loader(world_size))
    t.save_checkpoint(os.path.join(directory, "ddp.ckpt"))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(directory, "weights.pt"))


@pytest.fixture(scope="module")
def saved_by_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ddp")
    run_ranks(_ddp_fit_one_epoch_and_save, 2, str(directory))
    return directory


def test_ddp_checkpoint_resumes_under_zero3_at_another_world_size(saved_by_ddp, uninterrupted):
    _assert_continues_uninterrupted(run_ranks(_resume, 3, str(saved_by_ddp / "ddp.ckpt")), uninterrupted)


def _fine_tune(rank: int, world_size: int, path: str) -> list[float]:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    model = LitMLP()
    model.load_state_dict(torch.load(path, weights_only=True))  # before fit: sharding starts from it
    trainer(ZeRO3Strategy(), world_size, max_epochs=1).fit(model, loader(world_size))
    return model.step_losses


def test_plain_state_dict_file_fine_tunes_under_zero3(saved_by_ddp):
    weights = saved_by_ddp / "weights.pt"
    reference = LitMLP()
    reference.load_state_dict(torch.load(weights, weights_only=True))
    expected = reference_fit(reference, epochs=1)  # a fresh optimizer from the loaded weights
    for losses in run_ranks(_fine_tune, 2, str(weights)):
        assert max(abs(a - b) for a, b in zip(losses, expected)) < TOL


def test_plain_state_dict_as_ckpt_path_says_how_to_fine_tune(saved_by_ddp):
    with pytest.raises(CheckpointError, match="plain state dict.*load it into the model before fit"):
        read_full_file(saved_by_ddp / "weights.pt", trusted=False)


@pytest.mark.parametrize("saved, returned", [(2, 1), (1, 2)])
def test_a_full_checkpoint_of_another_number_of_optimizers_is_refused_before_any_loads(saved, returned):
    """One process: a full checkpoint's "optimizer_states" hold `saved` optimizers, the run
    configured `returned`: a CheckpointError naming both counts, and no optimizer changed."""
    from lightning_zero3.core import ShardedRun
    from lightning_zero3.engine import ShardedModel
    from lightning_zero3.options import LightningOptions
    from tests.models import MLP

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
