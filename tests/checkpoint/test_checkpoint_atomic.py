"""A save either replaces the checkpoint at its path with a complete new one or leaves the old one
as it was: a full disk, a rank that dies, an exception in a callback never leave a half checkpoint
where a good one was; ModelCheckpoint's rotation removes whole directories. Trainer runs are started by the strategy's
launcher (tests/support/adapted.py `launched`); the engine's saves run on the harness's ranks, where a
save failing on one rank must raise on every rank and a rank is killed mid-save."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.multiprocessing import ProcessRaisedException

from lightning_zero3 import checkpoint as ckpt
from lightning_zero3 import consolidate_checkpoint
from lightning_zero3.checkpoint.files import atomic_torch_save
from lightning_zero3.checkpoint.format import open_sharded
from tests.support.adapted import HandsBack, launched
from tests.support.checkpoints import save_trained_gpt, trained_gpt
from tests.support.lit import LitMLP, loader, trainer
from tests.support.ranks import run_ranks, run_ranks_while_one_dies


def _checkpoint_dict(model: Any, sharded: Any, optimizer: Any) -> dict[str, Any]:
    return {"state_dict": model.state_dict(), "optimizer_states": [ckpt.sharded_optimizer_state(sharded, optimizer)]}


def _fail_on_rank_1(failure: str) -> None:
    import torch.distributed.checkpoint as dcp

    def disk_full(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    def die(self: Any, plan: Any, planner: Any) -> Any:
        os._exit(1)

    dcp.FileSystemWriter.write_data = {"disk full": disk_full, "rank dies": die}[failure]


def _save_then_fail_to_save_again(rank: int, world_size: int, path: str, failure: str) -> tuple[dict, str]:
    """Save a good checkpoint, train one more step, then save again to the same path with rank 1
    failing; return the good checkpoint's weights and the error the second save raised here."""
    model, sharded, optimizer = trained_gpt()
    ckpt.save_sharded(path, sharded, _checkpoint_dict(model, sharded, optimizer))
    good = sharded.full_state_dict(to_rank=None)
    model, sharded, optimizer = trained_gpt(steps=3)
    checkpoint = _checkpoint_dict(model, sharded, optimizer)
    if rank == 1 and failure == "bad state on one rank":
        checkpoint["state_dict"]["wpe.weight"] = torch.zeros(3)  # not a shard of wpe.weight
    elif rank == 1:
        _fail_on_rank_1(failure)
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_sharded(path, sharded, checkpoint)
    return good, str(raised.value)


def _assert_holds(path: Path, weights: dict, tmp_path: Path) -> None:
    state_dict = torch.load(consolidate_checkpoint(path, tmp_path / "check.pt").dst)["state_dict"]
    assert weights, "nothing to compare"
    assert all(torch.equal(state_dict[k], v) for k, v in weights.items())
    os.remove(tmp_path / "check.pt")


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["disk full", "bad state on one rank"])
def test_a_save_failing_on_one_rank_raises_everywhere_and_keeps_the_previous_checkpoint(tmp_path, failure):
    path = tmp_path / "gpt.ckpt"
    results = run_ranks(_save_then_fail_to_save_again, 2, str(path), failure)
    for _, message in results:
        assert str(path) in message and "previous checkpoint there is unchanged" in message
    expected = {"disk full": "No space left on device", "bad state on one rank": "'wpe.weight' has 3 elements"}
    assert expected[failure] in results[0][1]
    assert os.listdir(tmp_path) == ["gpt.ckpt"]  # no partial directory left behind
    _assert_holds(path, results[0][0], tmp_path)


@pytest.mark.slow
def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "gpt.ckpt"
    good, message = run_ranks_while_one_dies(_save_then_fail_to_save_again, str(path), "rank dies")
    assert str(path) in message and "previous checkpoint there is unchanged" in message
    assert os.listdir(tmp_path) == ["gpt.ckpt"]
    _assert_holds(path, good, tmp_path)


def _save_with_rank_0_dying_once_the_checkpoint_is_in_place(rank: int, world_size: int, path: str) -> tuple:
    import lightning_zero3.checkpoint.save as save_module

    model, sharded, optimizer = trained_gpt()
    expected = sharded.full_state_dict(to_rank=None)
    if rank == 0:
        replace_path = save_module.replace_path

        def replace_then_die(new: Path, target: Path) -> None:
            replace_path(new, target)
            os._exit(1)

        save_module.replace_path = replace_then_die
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_sharded(path, sharded, _checkpoint_dict(model, sharded, optimizer))
    return expected, str(raised.value), repr(raised.value.__cause__)


@pytest.mark.slow
def test_rank_0_dying_late_in_a_save_is_a_checkpoint_error_on_rank_1(tmp_path):
    """The last agreement fails on rank 1: a CheckpointError naming the path and the lost rank,
    caused by the process group's error; the path holds a complete checkpoint (here the new one)."""
    path = tmp_path / "gpt.ckpt"
    saved, message, cause = run_ranks_while_one_dies(
        _save_with_rank_0_dying_once_the_checkpoint_is_in_place, str(path), survivor=1
    )
    assert f"Saving the checkpoint {path} failed as rank 0 put it in place" in message
    assert "another rank stopped answering" in message and "Error" in cause
    assert os.listdir(tmp_path) == ["gpt.ckpt"]
    _assert_holds(path, saved, tmp_path)


class _FailInSecondEpoch(Callback):
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        if trainer.current_epoch == 1:
            raise RuntimeError("callback failed while saving")


@pytest.mark.slow
def test_an_exception_in_a_callback_while_saving_leaves_the_previous_checkpoint(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, filename="latest")  # the same name every epoch
    t = trainer(launched("zero3"), 2, max_epochs=2, enable_checkpointing=True,
                callbacks=[_FailInSecondEpoch(), callback])  # fmt: skip
    with pytest.raises(ProcessRaisedException, match="RuntimeError: callback failed while saving"):
        t.fit(LitMLP(), loader(2))
    assert os.listdir(tmp_path) == ["latest.ckpt"]
    saved = open_sharded(tmp_path / "latest.ckpt")  # complete, checksums match
    assert saved.meta["lightning"]["epoch"] == 0


def _save_a_then_b(rank: int, world_size: int, path: str) -> dict:
    model, sharded, optimizer = trained_gpt(steps=1)
    ckpt.save_sharded(path, sharded, _checkpoint_dict(model, sharded, optimizer))
    model, sharded, optimizer = trained_gpt(steps=2)
    ckpt.save_sharded(path, sharded, _checkpoint_dict(model, sharded, optimizer))
    return sharded.full_state_dict(to_rank=None)


@pytest.mark.slow
def test_saving_again_to_a_path_replaces_the_checkpoint_there(tmp_path):
    path = tmp_path / "gpt.ckpt"
    second = run_ranks(_save_a_then_b, 2, str(path))[0]
    assert os.listdir(tmp_path) == ["gpt.ckpt"]
    _assert_holds(path, second, tmp_path)


@pytest.mark.slow
def test_a_full_file_and_a_sharded_directory_replace_each_other(tmp_path):
    path = tmp_path / "model.ckpt"
    atomic_torch_save({"state_dict": {}}, path)
    expected = run_ranks(save_trained_gpt, 2, str(path))[0][0]
    assert path.is_dir()
    _assert_holds(path, expected, tmp_path)
    atomic_torch_save({"state_dict": {"w": torch.ones(2)}}, path)
    assert path.is_file() and torch.equal(torch.load(path)["state_dict"]["w"], torch.ones(2))
    assert os.listdir(tmp_path) == ["model.ckpt"]


@pytest.mark.slow
@pytest.mark.parametrize("save_last", [True, "link"], ids=["last_copy", "last_link"])
def test_model_checkpoint_top_k_keeps_only_the_best_directories_and_last(tmp_path, save_last):
    torch.manual_seed(0)
    callback = ModelCheckpoint(
        dirpath=tmp_path, monitor="train_loss", save_top_k=2, every_n_train_steps=1, save_last=save_last
    )
    hands_back = HandsBack(best="checkpoint_callback.best_k_models", steps="global_step")
    t = trainer(launched("zero3"), 2, max_epochs=2, enable_checkpointing=True, callbacks=[callback, hands_back])
    t.fit(LitMLP(), loader(2))
    best = sorted(os.path.basename(p) for p in t.callback_metrics["best"][0])
    assert sorted(os.listdir(tmp_path)) == sorted([*best, "last.ckpt"])  # nothing else, nothing hidden
    assert (tmp_path / "last.ckpt").is_symlink() == (save_last == "link")
    for name in os.listdir(tmp_path):
        open_sharded(tmp_path / name)  # every one complete
    if save_last is True:
        assert open_sharded(tmp_path / "last.ckpt").meta["lightning"]["global_step"] == t.callback_metrics["steps"][0]


@pytest.mark.slow
def test_removing_a_link_keeps_its_target_and_removing_a_directory_leaves_nothing(tmp_path):
    target = tmp_path / "epoch=0.ckpt"
    run_ranks(save_trained_gpt, 2, str(target))
    (tmp_path / "last.ckpt").symlink_to(target.name)
    ckpt.remove_checkpoint(tmp_path / "last.ckpt")
    assert os.listdir(tmp_path) == ["epoch=0.ckpt"]
    open_sharded(target)
    ckpt.remove_checkpoint(target)
    assert os.listdir(tmp_path) == []
