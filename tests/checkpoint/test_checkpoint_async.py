"""`ZeRO3Strategy(async_save=True)`: sharded saves write in a background thread while training
goes on (Note: background saves in lightning_zero3/checkpoint/background.py). Trainer runs are
started by the strategy's launcher (tests/support/adapted.py `launched`), except those where every rank
must raise the same error (a failing background write on rank 1, also at teardown, where each
rank's module state is checked too) or one rank is killed (kill -9)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_zero3
from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, become_lightning_rank, loader, max_difference, reference_fit, trainer
from tests.support.ranks import RankFailure, run_ranks

TOL = 1e-5
STEPS_PER_EPOCH = 4


class _SeesSavesInFlight(Callback):
    """Records, at each batch, whether a save was left writing in the background; at the end of
    the run (its `teardown`, after the strategy's) asserts on this rank that training went on
    while a save was in flight exactly when saving in the background, and that the end of fit
    waited."""

    def __init__(self, async_save: bool) -> None:
        self.async_save = async_save
        self.seen: list[bool] = []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.seen.append(trainer.strategy.run.saving is not None)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        assert any(self.seen) == self.async_save, self.seen
        assert trainer.strategy.run is not None and trainer.strategy.run.saving is None


def _fit_saving_every_2_steps(strategy: Any, world_size: int, directory: str, async_save: bool) -> pl.Trainer:
    torch.manual_seed(0)
    model = LitMLP()
    every = ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    # save_top_k=1 rotates: each save removes the one before (deferred while a save writes).
    rotating = ModelCheckpoint(
        dirpath=directory, filename="latest-{step}", every_n_train_steps=2, save_top_k=1, monitor="step", mode="max"
    )
    callbacks = [every, rotating, _SeesSavesInFlight(async_save), HandsBack(losses="lightning_module.step_losses")]
    t = trainer(strategy, world_size, max_epochs=2, enable_checkpointing=True, callbacks=callbacks)
    t.fit(model, loader(world_size))
    return t


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[float]]]:
    out = {}
    for mode in ("sync", "async"):
        directory = tmp_path_factory.mktemp(mode)
        async_save = mode == "async"
        t = _fit_saving_every_2_steps(launched("zero3", async_save=async_save), 2, str(directory), async_save)
        out[mode] = (directory, t.callback_metrics["losses"][0])
    return out


@pytest.mark.slow
def test_saving_in_the_background_equals_saving_synchronously(runs):
    (sync_dir, sync_losses), (async_dir, async_losses) = runs["sync"], runs["async"]
    assert async_losses == sync_losses
    names = sorted(p.name for p in sync_dir.iterdir())
    assert names == ["latest-step=8.ckpt", "step=2.ckpt", "step=4.ckpt", "step=6.ckpt", "step=8.ckpt"]
    assert sorted(p.name for p in async_dir.iterdir()) == names  # nothing else: no temporary names left
    for name in names:
        a, b = (lightning_zero3.load_checkpoint(d / name) for d in (sync_dir, async_dir))
        assert max_difference(a["state_dict"], b["state_dict"]) == 0
        for index, entry in a["optimizer_states"][0]["state"].items():
            for key, value in entry.items():
                assert torch.equal(b["optimizer_states"][0]["state"][index][key], value), (name, index, key)
        assert a["global_step"] == b["global_step"] == int(name.split("=")[1].split(".")[0])


@pytest.mark.slow
def test_a_background_checkpoint_resumes_exactly_at_another_world_size(runs):
    torch.manual_seed(0)
    model = LitMLP()
    losses = reference_fit(model, epochs=2)
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    resumed = LitMLP()
    t = trainer(launched("zero3"), 1, max_epochs=2, callbacks=[HandsBack(losses="lightning_module.step_losses")])
    t.fit(resumed, loader(1), ckpt_path=runs["async"][0] / "step=4.ckpt")
    (step_losses,), final = t.callback_metrics["losses"], resumed.state_dict()
    assert len(step_losses) == STEPS_PER_EPOCH
    assert max(abs(a - b) for a, b in zip(step_losses, losses[STEPS_PER_EPOCH:])) < TOL
    assert max_difference(final, model.state_dict()) < TOL


def _fail_background_writes() -> None:
    """Every background write of this process raises after its part is written."""
    import lightning_zero3.checkpoint.save as save

    write = save.write_sharded

    def failing(*args: Any, **kwargs: Any) -> None:
        write(*args, **kwargs)
        raise OSError("injected failure in the background")

    save.write_sharded = failing  # type: ignore[assignment]


def _fit_with_a_failing_background_write_on_rank_1(rank: int, world_size: int, directory: str) -> None:
    """Rank 1's background write raises after its part is written (rank 0's succeeds): only
    the agreement at the next save can tell rank 0."""
    if rank == 1:
        _fail_background_writes()
    become_lightning_rank(rank, world_size)
    _fit_saving_every_2_steps(lightning_zero3.ZeRO3Strategy(async_save=True), world_size, directory, True)


@pytest.mark.slow
def test_an_error_in_the_background_write_is_raised_on_every_rank(tmp_path):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_fit_with_a_failing_background_write_on_rank_1, 2, str(tmp_path))
    message = str(failure.value)
    for rank in (0, 1):
        report = message.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "CheckpointError: Saving the checkpoint" in report and "in the background failed" in report
        assert "injected failure in the background (on rank 1)" in report
    assert os.listdir(tmp_path)  # the first save (step 2) is in place, whole
    assert lightning_zero3.load_checkpoint(tmp_path / "step=2.ckpt")["global_step"] == 2


def _fit_with_rank_0_killed_in_its_second_background_write(rank: int, world_size: int, directory: str) -> None:
    """Every 2 steps a save to one path, `latest.ckpt`; rank 0 is killed (kill -9) in the
    background thread of the second, once every shard is written, as it would put it in place."""
    import lightning_zero3.checkpoint.save as save

    if rank == 0:
        finish, calls = save._finish, []

        def killed_on_the_second(*args: Any, **kwargs: Any) -> None:
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            finish(*args, **kwargs)

        save._finish = killed_on_the_second  # type: ignore[assignment]
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    latest = ModelCheckpoint(
        dirpath=directory, filename="latest", every_n_train_steps=2, enable_version_counter=False, save_top_k=1,
        monitor="step", mode="max",
    )  # fmt: skip
    t = trainer(ZeRO3Strategy(async_save=True), world_size, max_epochs=1, enable_checkpointing=True, callbacks=[latest])
    t.fit(LitMLP(), loader(world_size))


@pytest.mark.slow
def test_kill_9_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(RankFailure, match="rank 0"):
        run_ranks(_fit_with_rank_0_killed_in_its_second_background_write, 2, str(tmp_path))
    assert lightning_zero3.load_checkpoint(tmp_path / "latest.ckpt")["global_step"] == 2


class _SavesTwiceRank0LostBetween(Callback):
    """At step 2 every rank saves a.ckpt in the background; rank 0 is then killed (kill -9), its
    write of a.ckpt in flight, and rank 1 goes on to save b.ckpt."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step != 2:
            return
        trainer.save_checkpoint(f"{self.directory}/a.ckpt")
        if trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.save_checkpoint(f"{self.directory}/b.ckpt")


def _fit_losing_rank_0_during_a_background_save(rank: int, world_size: int, directory: str) -> None:
    become_lightning_rank(rank, world_size)
    torch.manual_seed(0)
    strategy = lightning_zero3.ZeRO3Strategy(async_save=True)
    t = trainer(strategy, world_size, max_epochs=1, callbacks=[_SavesTwiceRank0LostBetween(directory)])
    t.fit(LitMLP(), loader(world_size))


@pytest.mark.slow
def test_a_rank_lost_during_a_background_save_is_a_checkpoint_error_on_the_survivor(tmp_path):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_fit_losing_rank_0_during_a_background_save, 2, str(tmp_path))
    survivor = str(failure.value).split("--- rank 1 ---")[1].split("--- rank")[0]
    assert (
        f"CheckpointError: Cannot save the checkpoint {tmp_path}/b.ckpt (the previous checkpoint there, if any, is "
        "unchanged): another rank stopped answering (RuntimeError: "
    ) in survivor, survivor
    assert not (tmp_path / "b.ckpt").exists()


def _fabric_saving_every_step(f: Any, directory: str, async_save: bool) -> list[float]:
    from tests.support.fabric_helpers import adamw, train_step
    from tests.support.models import MLP

    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    module = MLP()
    model, optimizer = f.setup(module, adamw(module))
    losses, in_flight = [], []
    for step in range(3):
        losses.append(train_step(f, model, optimizer, step, rank, world_size, None)[0])
        f.save(f"{directory}/step{step}", {"model": model, "optimizer": optimizer, "step": step})
        in_flight.append(any(run.saving is not None for run in f.strategy._runs.values()))
    assert all(in_flight) == async_save
    assert f.load(f"{directory}/step2", {"model": model, "optimizer": optimizer}) == {"step": 2}  # waits first
    return losses


@pytest.mark.slow
def test_fabric_saves_in_the_background_equal_synchronous_ones(tmp_path):
    from tests.support.fabric_helpers import launch

    results = {}
    for mode in ("sync", "async"):
        (tmp_path / mode).mkdir()
        results[mode] = launch(
            _fabric_saving_every_step, str(tmp_path / mode), mode == "async", async_save=mode == "async"
        )
    assert results["sync"] == results["async"]
    for step in range(3):
        a, b = (lightning_zero3.load_checkpoint(tmp_path / mode / f"step{step}") for mode in ("sync", "async"))
        assert max_difference(a["state_dict"], b["state_dict"]) == 0
        for index, entry in a["optimizer_states"][0]["state"].items():
            for key, value in entry.items():
                assert torch.equal(b["optimizer_states"][0]["state"][index][key], value)


def _last_background_write_fails_on_rank_1(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """The last save of fit (step 2 of 2) fails in rank 1's background: only teardown's wait
    sees it. It is raised on every rank, after teardown left the module at rest as usual."""
    if rank == 1:
        _fail_background_writes()
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy
    from lightning_zero3.common.run import Lifecycle

    model = LitMLP()
    every = ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    strategy = ZeRO3Strategy(async_save=True)
    t = trainer(strategy, world_size, max_steps=2, enable_checkpointing=True, callbacks=[every])
    try:
        t.fit(model, loader(world_size))
    except Exception as err:  # Lightning re-raises teardown's error
        raised = str(err)
    else:
        raised = ""
    assert strategy.run is not None
    return {"raised": raised, "state": strategy.run.state is Lifecycle.AT_REST, "dim": model.net.inp.weight.dim()}


@pytest.mark.slow
def test_an_error_of_the_last_background_write_is_raised_at_teardown_after_it_completes(tmp_path):
    for result in run_ranks(_last_background_write_fails_on_rank_1, 2, str(tmp_path)):
        assert "in the background failed" in result["raised"], result
        assert result["state"] and result["dim"] == 1, result  # this rank's shard


@pytest.mark.parametrize("fails", [True, False])
def test_a_removal_asked_for_while_a_save_writes_runs_once_it_succeeded(tmp_path, fails: bool) -> None:
    """ModelCheckpoint's rotation under async_save (core.remove_checkpoint): the old checkpoint
    goes only once the new one is in place, and stays if the new one failed."""
    from lightning_zero3.checkpoint.background import BackgroundSave
    from lightning_zero3.common.run import remove_checkpoint

    old = tmp_path / "old.ckpt"
    old.touch()  # an empty file: something a save may replace
    release = threading.Event()

    def write() -> None:
        release.wait()
        if fails:
            raise OSError("injected failure in the background")

    saving = BackgroundSave(write, what="the new checkpoint")
    remove_checkpoint(old, None, after=saving)
    try:
        assert old.exists()  # the new one is still being written
    finally:
        release.set()  # else a failure here leaves the writer waiting and pytest hanging at exit
    saving.wait()
    assert old.exists() == fails


class _Rank0KilledAfterItsSave(Callback):
    """At step 2 every rank calls `trainer.save_checkpoint`; rank 0 is killed (kill -9) once its
    save has returned, before Lightning's barrier that ends `trainer.save_checkpoint`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 2:
            save = trainer.strategy.save_checkpoint
            if trainer.global_rank == 0:
                trainer.strategy.save_checkpoint = lambda *a, **k: (save(*a, **k), os.kill(os.getpid(), signal.SIGKILL))
            trainer.save_checkpoint(f"{self.directory}/a.ckpt")


def _fit_losing_rank_0_after_its_save(rank: int, world_size: int, directory: str) -> None:
    become_lightning_rank(rank, world_size)
    torch.manual_seed(0)
    killed = _Rank0KilledAfterItsSave(directory)
    t = trainer(lightning_zero3.ZeRO3Strategy(), world_size, max_epochs=1, callbacks=[killed])
    t.fit(LitMLP(), loader(world_size))


@pytest.mark.slow
def test_a_rank_lost_in_lightnings_barrier_after_a_save_is_a_collective_error_naming_it(tmp_path):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_fit_losing_rank_0_after_its_save, 2, str(tmp_path))
    survivor = str(failure.value).split("--- rank 1 ---")[1].split("--- rank")[0]
    assert (
        "CollectiveError: ZeRO3Strategy: Lightning's barrier 'Trainer.save_checkpoint' failed on rank 1 of 2: rank 0 "
        "stopped answering (RuntimeError: "
    ) in survivor, survivor


def _lost_in_a_control_collective(rank: int, world_size: int, strategy: str, call: str) -> None:
    """Rank 0 is killed (kill -9); rank 1 makes a collective Lightning asks of the strategy."""
    made = getattr(lightning_zero3, strategy)(parallel_devices=[torch.device("cpu")] * world_size)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if call == "broadcast":  # ModelCheckpoint's dirpath, Trainer.save_checkpoint's path
        made.broadcast("dirpath")
    else:  # ModelCheckpoint's decision to save, EarlyStopping's to stop
        made.reduce_boolean_decision(True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "call", "collective"),
    [("ZeRO3Strategy", "broadcast", "broadcast from rank 0"), ("ZeRO3FabricStrategy", "broadcast", "broadcast from "
     "rank 0"), ("ZeRO3Strategy", "reduce_boolean_decision", "reduce")],
)  # fmt: skip
def test_a_rank_lost_in_a_control_collective_is_a_collective_error_naming_it(strategy, call, collective):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_lost_in_a_control_collective, 2, strategy, call)
    survivor = str(failure.value).split("--- rank 1 ---")[1].split("--- rank")[0]
    assert (
        f"CollectiveError: {strategy}: Lightning's {collective} failed on rank 1 of 2: rank 0 stopped answering ("
    ) in survivor, survivor
