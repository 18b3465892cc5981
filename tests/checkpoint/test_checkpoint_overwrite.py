"""Saving never destroys what is not a checkpoint (Note: what a save may replace): a directory or
file of the user's at the path is refused, untouched, on every rank, for both state_dict_types;
removal leaves it too; `consolidate` never writes into its source and leaves nothing half-written
when the disk is full. The Trainer test stays on the harness's ranks: every rank must raise the
same error, for each kind in turn."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import resource
import signal
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero3 import checkpoint as ckpt
from lightning_zero3 import consolidate_checkpoint
from lightning_zero3.__main__ import main
from lightning_zero3.checkpoint.files import atomic_torch_save
from lightning_zero3.checkpoint.format import open_sharded
from tests.support.checkpoints import save_mlp
from tests.support.lit import LitMLP, become_lightning_rank, loader, trainer
from tests.support.ranks import _mp_context, run_ranks


def _project(path: Path) -> dict[str, bytes]:
    """A user's directory (not a checkpoint) at `path`; returns its contents."""
    (path / "src").mkdir(parents=True)
    (path / "README.md").write_text("my project\n")
    (path / "src" / "train.py").write_text("print('hello')\n")
    return _contents(path)


def _contents(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---- saving over something that is not a checkpoint ----------------------------------------
def test_a_sharded_save_over_a_user_directory_is_refused_and_touches_nothing(tmp_path):
    before = _project(tmp_path / "my_project")
    with pytest.raises(ckpt.CheckpointError) as raised:
        save_mlp(tmp_path / "my_project")
    message = str(raised.value)
    assert f"Refusing to save over {tmp_path / 'my_project'}: it is a directory that is not a" in message
    assert "'README.md'" in message and "Nothing was changed" in message
    assert _contents(tmp_path / "my_project") == before
    assert os.listdir(tmp_path) == ["my_project"]  # no partial directory either


@pytest.mark.parametrize("what", ["directory", "text file"])
def test_a_full_save_over_a_user_directory_or_file_is_refused_and_touches_nothing(tmp_path, what):
    path = tmp_path / "target"
    if what == "directory":
        before = _project(path)
    else:
        path.write_text("notes\n")
    with pytest.raises(ckpt.CheckpointError, match=f"Refusing to save over {path}"):
        atomic_torch_save({"state_dict": {}}, path)
    assert (_contents(path) == before) if what == "directory" else path.read_text() == "notes\n"
    assert os.listdir(tmp_path) == ["target"]


@pytest.mark.slow
def test_a_checkpoint_directory_holding_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "mlp.ckpt"
    save_mlp(path)
    (path / "notes.txt").write_text("mine")
    with pytest.raises(ckpt.CheckpointError, match="also holds files not of the checkpoint: 'notes.txt'"):
        save_mlp(path, seed=1)
    assert (path / "notes.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("what", ["nothing", "an empty directory", "a checkpoint", "a torch file", "a link"])
def test_a_save_replaces_a_checkpoint_an_empty_directory_or_a_link(tmp_path, what):
    path = tmp_path / "mlp.ckpt"
    if what == "an empty directory":
        path.mkdir()
    elif what == "a checkpoint":
        save_mlp(path, seed=1)
    elif what == "a torch file":
        torch.save({"state_dict": {}}, path)
    elif what == "a link":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "keep.txt").write_text("kept")
        path.symlink_to(tmp_path / "elsewhere")
    expected = save_mlp(path)
    loaded = torch.load(consolidate_checkpoint(path, tmp_path / "out.pt").dst, weights_only=True)["state_dict"]
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    if what == "a link":
        assert (tmp_path / "elsewhere" / "keep.txt").read_text() == "kept"  # the link went, not its target


def _save_over_a_project(rank: int, world_size: int, path: str) -> list[str]:
    """Fit one step, then trainer.save_checkpoint onto a user's directory with either kind."""
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    strategy = ZeRO3Strategy()
    t = trainer(strategy, world_size, max_steps=1)
    t.fit(LitMLP(), loader(world_size))
    messages = []
    for kind in ("sharded", "full"):
        strategy.lightning_options = dataclasses.replace(strategy.lightning_options, state_dict_type=kind)
        with pytest.raises(ckpt.CheckpointError) as raised:
            t.save_checkpoint(path)
        messages.append(str(raised.value))
    return messages


def test_trainer_save_checkpoint_over_a_user_directory_fails_on_every_rank_for_both_kinds(tmp_path):
    before = _project(tmp_path / "my_project")
    for messages in run_ranks(_save_over_a_project, 2, str(tmp_path / "my_project")):
        for message in messages:
            assert f"Refusing to save over {tmp_path / 'my_project'}" in message
    assert _contents(tmp_path / "my_project") == before
    assert os.listdir(tmp_path) == ["my_project"]


# ---- removing ------------------------------------------------------------------------------
def test_remove_checkpoint_refuses_a_user_directory(tmp_path):
    before = _project(tmp_path / "my_project")
    with pytest.raises(ckpt.CheckpointError, match=f"Refusing to remove {tmp_path / 'my_project'}"):
        ckpt.remove_checkpoint(tmp_path / "my_project")
    assert _contents(tmp_path / "my_project") == before


def test_the_strategy_leaves_a_user_directory_with_a_warning(tmp_path, caplog):
    """ModelCheckpoint calls it on rank 0 only: a warning keeps the ranks in step."""
    from lightning_zero3 import ZeRO3Strategy

    before = _project(tmp_path / "my_project")
    with caplog.at_level(logging.WARNING):
        ZeRO3Strategy().remove_checkpoint(tmp_path / "my_project")
    assert f"Refusing to remove {tmp_path / 'my_project'}" in caplog.text
    assert _contents(tmp_path / "my_project") == before


# ---- consolidate: the destination ----------------------------------------------------------
@pytest.mark.parametrize("dst", ["meta.json", "trainer_state.pt", "new.pt", ".", "link"])
def test_consolidate_refuses_a_destination_inside_the_source_before_writing(gpt_checkpoint, capsys, dst):
    (gpt_checkpoint.parent / "link").symlink_to(gpt_checkpoint.name)  # the source under another name
    before = _contents(gpt_checkpoint)
    target = gpt_checkpoint.parent / "link" if dst == "link" else gpt_checkpoint / dst
    assert main(["consolidate", str(gpt_checkpoint), str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {target}: it is ")
    assert f"checkpoint {gpt_checkpoint} being consolidated" in err
    assert _contents(gpt_checkpoint) == before
    open_sharded(gpt_checkpoint)  # still complete, checksums match


def test_consolidate_refuses_to_overwrite_a_file_that_is_not_a_checkpoint(gpt_checkpoint, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["consolidate", str(gpt_checkpoint), str(tmp_path / "notes.txt")]) == 1
    assert f"error: Refusing to save over {tmp_path / 'notes.txt'}" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _consolidate_with_a_file_size_limit(limit: int, argv: list[str], stderr: str) -> None:
    """The CLI in a child process whose writes fail with EFBIG past `limit` bytes (as on a full
    disk: SIGXFSZ ignored); exits with the CLI's status, its stderr written to `stderr`."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    with open(stderr, "w") as err, contextlib.redirect_stderr(err):
        status = main(argv)
    sys.exit(status)


@pytest.mark.parametrize("output", ["torch", "safetensors"])
def test_consolidate_onto_a_full_disk_exits_1_with_a_message_and_removes_the_partial_file(
    gpt_checkpoint, tmp_path, output
):
    dst = tmp_path / "out" / "gpt.pt"
    dst.parent.mkdir()
    consolidate_checkpoint(gpt_checkpoint, dst, safetensors=output == "safetensors")
    previous = dst.read_bytes()
    assert len(previous) > 20_000
    argv = ["consolidate", str(gpt_checkpoint), str(dst)] + (["--safetensors"] if output == "safetensors" else [])
    child = _mp_context().Process(target=_consolidate_with_a_file_size_limit, args=(20_000, argv, tmp_path / "err"))
    child.start()
    child.join(timeout=120)
    stderr = (tmp_path / "err").read_text()
    assert child.exitcode == 1, stderr  # not 134 (std::terminate) nor a signal
    assert stderr.startswith(f"error: writing {dst} failed: ") and f"{os.strerror(errno.EFBIG)}" in stderr, stderr
    assert os.listdir(dst.parent) == ["gpt.pt"] and dst.read_bytes() == previous  # old output kept, no partial
