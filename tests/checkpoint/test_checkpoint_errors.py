"""Bad input: each raises a `CheckpointError` whose message names the problem and the path, on
every rank alike (never a hang), and the CLI exits non-zero with that message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero3 import CheckpointError, consolidate_checkpoint
from lightning_zero3 import checkpoint as ckpt
from lightning_zero3.__main__ import main
from lightning_zero3.checkpoint.full import read_full_file
from tests.support.checkpoints import load_into_fresh_gpt
from tests.support.ranks import run_ranks


def _refused(path: Path, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as raised:
        consolidate_checkpoint(path, path.parent / "out.pt")
    assert str(path) in str(raised.value)
    assert not (path.parent / "out.pt").exists()
    return str(raised.value)


def test_a_path_that_does_not_exist_is_refused(tmp_path):
    _refused(tmp_path / "nothing.ckpt", "does not exist")


def test_a_directory_without_meta_json_is_not_a_checkpoint(tmp_path):
    (tmp_path / "logs").mkdir()
    _refused(tmp_path / "logs", "is not a checkpoint: it has no meta.json")


def test_a_file_is_not_a_sharded_checkpoint_and_not_a_torch_checkpoint(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    _refused(notes, "is a file, not a sharded checkpoint directory")
    with pytest.raises(CheckpointError, match=f"{notes} is not a checkpoint torch can read"):
        read_full_file(notes, trusted=False)


@pytest.mark.slow
def test_an_interrupted_save_is_not_mistaken_for_a_checkpoint(gpt_checkpoint):
    (gpt_checkpoint / "meta.json").unlink()
    _refused(gpt_checkpoint, "has shard files but no meta.json: the save that wrote it did not finish")


def test_a_missing_rank_shard_is_named(gpt_checkpoint):
    (gpt_checkpoint / "__1_0.distcp").unlink()
    _refused(gpt_checkpoint, r"rank 1's shard file .*__1_0.distcp is missing")


def test_a_truncated_shard_is_detected_by_its_size(gpt_checkpoint):
    shard = gpt_checkpoint / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    _refused(gpt_checkpoint, r"rank 0's shard file .*__0_0.distcp is truncated or damaged: 1000 bytes, expected \d+")


def test_a_corrupted_shard_is_detected_by_its_checksum(gpt_checkpoint):
    shard = gpt_checkpoint / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _refused(gpt_checkpoint, r"__1_0.distcp is corrupted: CRC-32 [0-9a-f]{8} does not match [0-9a-f]{8} in meta.json")


def test_an_unknown_format_version_is_refused(gpt_checkpoint):
    meta = json.loads((gpt_checkpoint / "meta.json").read_text())
    meta["format_version"] = 99
    (gpt_checkpoint / "meta.json").write_text(json.dumps(meta))
    _refused(gpt_checkpoint, "has checkpoint format version 99, but this lightning_zero3 reads version 1")


def test_a_garbled_meta_json_is_reported_as_corrupted(gpt_checkpoint):
    (gpt_checkpoint / "meta.json").write_text("{ not json")
    _refused(gpt_checkpoint, "meta.json is corrupted")


def _load_and_report(rank: int, world_size: int, path: str) -> str:
    with pytest.raises(CheckpointError) as raised:
        load_into_fresh_gpt(rank, world_size, path)
    return str(raised.value)


def test_a_problem_only_one_rank_sees_fails_every_rank(gpt_checkpoint):
    """Files are checksummed by one rank each; the corrupted one here is checked by rank 1 only,
    and rank 0 must not go on into the collective load."""
    files = sorted(json.loads((gpt_checkpoint / "meta.json").read_text())["files"])
    assert files[1::2][0] == "__0_0.distcp"  # rank 1 of 2 checks every second file
    shard = gpt_checkpoint / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    for message in run_ranks(_load_and_report, 2, str(gpt_checkpoint), timeout_s=20):
        assert f"Cannot load the checkpoint {gpt_checkpoint}" in message and "__0_0.distcp is corrupted" in message


def _load_into_another_model(rank: int, world_size: int, path: str) -> str:
    from lightning_zero3 import ShardedModel
    from tests.support.models import TinyGPT

    with pytest.raises(CheckpointError) as raised:
        ckpt.load_sharded(path, ShardedModel(TinyGPT(depth=3)))
    return str(raised.value)


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys(gpt_checkpoint):
    for message in run_ranks(_load_into_another_model, 2, str(gpt_checkpoint)):
        assert f"checkpoint {gpt_checkpoint} holds another model" in message
        assert "keys of the model are not in the checkpoint: 'blocks.2.ln1.weight'" in message


def test_the_cli_exits_non_zero_with_the_message(gpt_checkpoint, capsys):
    (gpt_checkpoint / "__1_0.distcp").unlink()
    assert main(["consolidate", str(gpt_checkpoint), str(gpt_checkpoint.parent / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "__1_0.distcp is missing" in err and str(gpt_checkpoint) in err


@pytest.mark.slow
def test_python_m_lightning_zero3_exits_non_zero_with_the_message(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "lightning_zero3", "consolidate", str(tmp_path / "absent"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert f"error: {tmp_path / 'absent'} does not exist" in result.stderr
