"""Saves that meet other saves and dead ones (Note: temporary names in checkpoint/files.py): two
jobs saving to one path each put a whole checkpoint of their own in place, never a mix; a
temporary name planted by someone else is never followed or removed; a save killed mid-way
leaves a temporary directory that the next save to that path removes, and only that."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_zero3
from lightning_zero3 import ShardedModel, consolidate_checkpoint
from lightning_zero3 import checkpoint as ckpt
from lightning_zero3.engine.state import full_optimizer_state
from tests.support.checkpoints import save_mlp
from tests.support.models import MLP
from tests.support.ranks import run_ranks, run_ranks_while_one_dies

SAVES = 12  # per job; on the code before unique temporary names, 2-5 of them failed per run


def _mlp_job(seed: int) -> tuple[Any, ShardedModel, Any]:
    torch.manual_seed(seed)
    model = MLP()
    sharded = ShardedModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    return model, sharded, optimizer


def _save_repeatedly(rank: int, world_size: int, path: str, seed: int, rendezvous: str) -> tuple[list[str], Any, Any]:
    """One job: wait for the other job (a file each), then save SAVES times to `path`; return
    the failures seen (as text), when the saves began and ended, and the job's whole state."""
    model, sharded, optimizer = _mlp_job(seed)
    checkpoint = {
        "job": seed,
        "state_dict": model.state_dict(),
        "optimizer_states": [ckpt.sharded_optimizer_state(sharded, optimizer)],
    }
    Path(f"{rendezvous}.{seed}").touch()
    deadline = time.monotonic() + 60
    while not Path(f"{rendezvous}.{1 - seed}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    failures, start = [], time.time()
    for _ in range(SAVES):
        try:
            ckpt.save_sharded(path, sharded, checkpoint)
        except Exception as err:  # noqa: BLE001 - every failure is reported to the test
            failures.append(f"{type(err).__name__}: {err}")
    span = (start, time.time())
    whole = sharded.full_state_dict(to_rank=None), full_optimizer_state(sharded, optimizer, to_rank=None)
    return failures, span, whole


@pytest.mark.slow
def test_two_jobs_saving_to_one_path_each_put_a_whole_checkpoint_in_place(tmp_path):
    """Two independent jobs (2 ranks and 1 rank, two process groups) save to one path at once:
    every save succeeds, and what is at the path is all of one job's state (weights, optimizer
    state and extra entries agree), loadable, with nothing left beside it."""
    path = tmp_path / "run" / "last.ckpt"
    results: dict[int, Any] = {}

    def job(seed: int, world_size: int) -> None:
        try:
            results[seed] = run_ranks(_save_repeatedly, world_size, str(path), seed, str(tmp_path / "ready"))
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's thread
            results[seed] = err

    threads = [threading.Thread(target=job, args=(seed, world)) for seed, world in ((0, 2), (1, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in (0, 1):
        assert not isinstance(results[seed], BaseException), results[seed]
        failures = [f for rank_failures, _, _ in results[seed] for f in rank_failures]
        assert not failures, f"job {seed}: {len(failures)} failed saves, e.g. {failures[0]}"
    (a_start, a_end), (b_start, b_end) = results[0][0][1], results[1][0][1]
    assert a_start < b_end and b_start < a_end, "the two jobs did not save at the same time"
    assert os.listdir(path.parent) == ["last.ckpt"]
    saved = lightning_zero3.load_checkpoint(path)
    weights, optimizer = results[saved["job"]][0][2]
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in weights.items())
    saved_optimizer = saved["optimizer_states"][0]
    assert saved_optimizer["param_groups"] == optimizer["param_groups"]  # the lr differs between the jobs
    for index, entry in optimizer["state"].items():
        assert all(torch.equal(saved_optimizer["state"][index][k], v) for k, v in entry.items())


TRIES = 4000  # per process; on the code before the parent's lock, 16 of the 8000 lost their name


def _make_and_close_temporary_names(rank: int, world_size: int, path: str) -> list[str]:
    """Make and close temporary names next to `path` TRIES times (directories and files in turn,
    each save's sweep of stale ones first), the ranks at once; the failures seen."""
    from lightning_zero3.checkpoint.files import Partial

    failures = []
    for i in range(TRIES):
        try:
            Partial(Path(path), directory=i % 2 == 0).close(remove=True)
        except OSError as err:
            failures.append(f"{type(err).__name__}: {err}")
    return failures


@pytest.mark.slow
def test_a_new_temporary_name_is_never_swept_away_by_another_save_before_it_is_locked(tmp_path):
    """Two processes saving next to one path: neither removes the other's new (empty, not yet
    locked) temporary directory as a stale one (issue 30.2)."""
    failures = run_ranks(_make_and_close_temporary_names, 2, str(tmp_path / "last.ckpt"))
    lost = [f for rank in failures for f in rank]
    assert not lost, f"{len(lost)} of {2 * TRIES} temporary names lost, e.g. {lost[0]}"
    assert os.listdir(tmp_path) == []


def _fixed_token(monkeypatch: pytest.MonkeyPatch) -> str:
    """Make the next temporary names predictable, so that a test can plant something there."""
    import lightning_zero3.checkpoint.files as files

    token = "0123456789abcdef"
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: token)
    return token


@pytest.mark.parametrize("output", ["torch", "safetensors"])
@pytest.mark.parametrize("planted_at", ["the old name", "this save's name"])
def test_consolidate_never_follows_a_link_planted_at_its_temporary_name(tmp_path, monkeypatch, output, planted_at):
    save_mlp(tmp_path / "mlp.ckpt")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    dst = tmp_path / "out.ckpt"
    name = ".out.ckpt.zero3-partial"
    if planted_at == "this save's name":
        name = f".out.ckpt.{_fixed_token(monkeypatch)}.zero3-partial"
    (tmp_path / name).symlink_to(victim)
    try:
        consolidate_checkpoint(tmp_path / "mlp.ckpt", dst, safetensors=output == "safetensors")
    except FileExistsError:
        assert planted_at == "this save's name"  # refused, not followed
    else:
        assert planted_at == "the old name" and dst.is_file()
    assert victim.read_text() == "precious\n"
    assert (tmp_path / name).is_symlink()  # someone else's link stays


@pytest.mark.parametrize("planted_at", ["the old name", "this save's name"])
def test_consolidate_never_removes_a_directory_at_its_temporary_name(tmp_path, monkeypatch, planted_at):
    save_mlp(tmp_path / "mlp.ckpt")
    name = ".out.ckpt.zero3-partial"
    if planted_at == "this save's name":
        name = f".out.ckpt.{_fixed_token(monkeypatch)}.zero3-partial"
    (tmp_path / name / "mine").mkdir(parents=True)
    (tmp_path / name / "mine" / "notes.txt").write_text("kept\n")
    try:
        consolidate_checkpoint(tmp_path / "mlp.ckpt", tmp_path / "out.ckpt")
    except FileExistsError:
        assert planted_at == "this save's name"
    else:
        assert planted_at == "the old name" and (tmp_path / "out.ckpt").is_file()
    assert (tmp_path / name / "mine" / "notes.txt").read_text() == "kept\n"


def _save_with_rank_0_killed_while_writing(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    if rank == 0:

        def killed(self: Any, plan: Any, planner: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.FileSystemWriter.write_data = killed
    model, sharded, optimizer = _mlp_job(0)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.save_sharded(path, sharded, {"state_dict": model.state_dict()})


@pytest.mark.slow
def test_the_next_save_removes_what_a_killed_save_left_and_nothing_else(tmp_path):
    """kill -9 of rank 0 during a sharded save leaves its temporary directory; the next save to
    that path removes it. A live save's (locked) temporary name, one holding a file no save
    writes, and one of another path stay."""
    path = tmp_path / "mlp.ckpt"
    save_mlp(path)
    run_ranks_while_one_dies(_save_with_rank_0_killed_while_writing, str(path), survivor=1)
    left = [name for name in os.listdir(tmp_path) if name != "mlp.ckpt"]
    assert len(left) == 1 and left[0].startswith(".mlp.ckpt.") and left[0].endswith(".zero3-partial"), left
    live = tmp_path / ".mlp.ckpt.00000000000000aa.zero3-partial"
    foreign = tmp_path / ".mlp.ckpt.00000000000000bb.zero3-partial"
    other = tmp_path / ".other.ckpt.00000000000000cc.zero3-partial"
    for directory in (live, foreign, other):
        directory.mkdir()
    (foreign / "notes.txt").write_text("not a save's file\n")
    lock = os.open(live, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as the process saving into it holds it
    try:
        weights = save_mlp(path, seed=1)
    finally:
        os.close(lock)
    assert sorted(os.listdir(tmp_path)) == sorted(["mlp.ckpt", live.name, foreign.name, other.name])
    state_dict = lightning_zero3.load_checkpoint(path)["state_dict"]
    assert all(torch.equal(state_dict[k], v) for k, v in weights.items())


@pytest.mark.slow
def test_the_swap_puts_back_what_is_no_longer_a_checkpoint(tmp_path, monkeypatch):
    """Something that is not a checkpoint put at the path while the save ran (after the check
    at its start) is swapped back, untouched, and the save fails naming it."""
    import lightning_zero3.checkpoint.save as save_module

    path = tmp_path / "mlp.ckpt"
    save_mlp(path)
    write_json = save_module.write_json_atomically

    def then_a_user_directory_appears(obj: Any, file: Path) -> None:
        write_json(obj, file)
        ckpt.remove_checkpoint(path)
        (path / "src").mkdir(parents=True)
        (path / "README.md").write_text("my project\n")

    monkeypatch.setattr(save_module, "write_json_atomically", then_a_user_directory_appears)
    with pytest.raises(ckpt.CheckpointError, match=f"Refusing to save over {path}: .*appeared there during the save"):
        save_mlp(path, seed=1)
    assert sorted(os.listdir(path)) == ["README.md", "src"]
    assert os.listdir(tmp_path) == ["mlp.ckpt"]
