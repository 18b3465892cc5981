"""Consolidation writes one ordinary checkpoint file from a sharded directory, offline, one
tensor at a time: plain torch.load reads it, tied weights are present under every name, and
peak memory does not grow with the size of the output."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_zero3 import consolidate_checkpoint
from lightning_zero3.__main__ import ProgressBar, main
from lightning_zero3.checkpoint import Progress
from tests.support.checkpoints import save_trained_gpt
from tests.support.ranks import run_ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[dict, dict]]:
    """A TinyGPT checkpoint from 3 ranks (uneven shards) and the whole model and optimizer state."""
    path = tmp_path_factory.mktemp("consolidate") / "gpt.ckpt"
    expected = run_ranks(save_trained_gpt, 3, str(path))[0]
    return path, expected


@pytest.mark.slow
@pytest.mark.parametrize("mmap", [False, True])
def test_consolidated_file_is_an_ordinary_checkpoint_with_whole_tensors(saved, tmp_path, mmap):
    path, (model, optimizer) = saved
    summary = consolidate_checkpoint(path, tmp_path / "gpt.pt")
    loaded = torch.load(summary.dst, weights_only=True, mmap=mmap)
    assert list(loaded) == ["epoch", "state_dict", "optimizer_states", "note"]  # the order it was saved in
    assert loaded["epoch"] == 3 and loaded["note"] == "kept"
    assert list(loaded["state_dict"]) == list(model)  # the module's own keys, in its order
    for key, value in model.items():
        assert loaded["state_dict"][key].shape == value.shape and torch.equal(loaded["state_dict"][key], value), key
    state = loaded["optimizer_states"][0]
    assert state["param_groups"] == optimizer["param_groups"]
    for index, entry in optimizer["state"].items():
        for key, value in entry.items():
            assert torch.equal(state["state"][index][key], value), (index, key)
    assert summary.world_size == 3 and summary.file_bytes == summary.dst.stat().st_size


def test_the_streamed_torch_file_is_a_valid_zip_whose_tensor_records_are_64_byte_aligned(tmp_path):
    """checkpoint/streaming.py, Note: the torch.save file format: our own writer's output is a
    zip any tool accepts (CRCs checked), each data record starts on the storage alignment, and
    tensors given in memory (callback states) are written alongside the streamed ones, shared
    where they were shared."""
    from lightning_zero3.checkpoint.streaming import Deferred, stream_torch_save

    real = torch.tensor([1.5, -2.5], requires_grad=True)
    obj = {"w": Deferred((2, 5), torch.float32, lambda: torch.arange(10.0)), "bf": Deferred((3,), torch.bfloat16,
           lambda: torch.ones(3)), "extra": {"score": real, "again": real}, "step": 7}  # fmt: skip
    file = tmp_path / "f.pt"
    with open(file, "wb") as f:
        stream_torch_save(obj, f, lambda nbytes: None)
    with zipfile.ZipFile(file) as archive, open(file, "rb") as raw:
        assert archive.testzip() is None
        for info in archive.infolist():
            raw.seek(info.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", raw.read(4))
            if "/data/" in info.filename:
                assert (info.header_offset + 30 + name_length + extra_length) % 64 == 0, info.filename
    for mmap in (False, True):
        loaded = torch.load(file, weights_only=True, mmap=mmap)
        assert torch.equal(loaded["w"], torch.arange(10.0).view(2, 5)) and loaded["bf"].dtype == torch.bfloat16
        assert torch.equal(loaded["extra"]["score"], real.detach()) and loaded["extra"]["score"].requires_grad
        assert loaded["extra"]["again"] is loaded["extra"]["score"] and loaded["step"] == 7


def test_tied_weights_are_present_under_every_name_sharing_one_storage(saved, tmp_path):
    path, _ = saved
    state_dict = torch.load(consolidate_checkpoint(path, tmp_path / "gpt.pt").dst, weights_only=True)["state_dict"]
    assert state_dict["lm_head.weight"].data_ptr() == state_dict["wte.weight"].data_ptr()


def test_weights_only_leaves_out_optimizer_state_and_dtype_casts_the_weights(saved, tmp_path):
    path, (model, _) = saved
    loaded = torch.load(consolidate_checkpoint(path, tmp_path / "w.pt", weights_only=True, dtype="bf16").dst)
    assert "optimizer_states" not in loaded
    for key, value in model.items():
        assert loaded["state_dict"][key].dtype == torch.bfloat16
        assert torch.equal(loaded["state_dict"][key], value.to(torch.bfloat16)), key


def test_a_checkpoint_saved_without_optimizer_state_consolidates_without_it(tmp_path):
    """A weights-only save (ModelCheckpoint(save_weights_only=True)), here from one process."""
    from lightning_zero3 import ShardedModel
    from lightning_zero3.checkpoint import save_sharded
    from tests.support.models import MLP

    model = MLP()
    sharded = ShardedModel(model)
    save_sharded(tmp_path / "mlp.ckpt", sharded, {"epoch": 1, "state_dict": model.state_dict()})
    expected = sharded.full_state_dict(to_rank=None)
    loaded = torch.load(consolidate_checkpoint(tmp_path / "mlp.ckpt", tmp_path / "mlp.pt").dst, weights_only=True)
    assert list(loaded) == ["epoch", "state_dict"]
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in expected.items())


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A reader written from the format's specification, so the test does not need the package."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__")
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    body = data[8 + length :]
    assert max(end for _, end in (h["data_offsets"] for h in header.values())) == len(body)
    tensors = {}
    for name, h in header.items():
        start, end = h["data_offsets"]
        raw = torch.frombuffer(bytearray(body[start:end]), dtype=torch.uint8)
        tensors[name] = raw.view(dtypes[h["dtype"]]).reshape(h["shape"])
    return tensors, metadata


def test_safetensors_output_holds_the_state_dict_under_every_name(saved, tmp_path):
    path, (model, _) = saved
    out = consolidate_checkpoint(path, tmp_path / "gpt.safetensors", safetensors=True, dtype="fp16").dst
    tensors, metadata = _read_safetensors(out)
    assert metadata["format"] == "pt" and metadata["epoch"] == "3"
    assert set(tensors) == set(model)
    for key, value in model.items():
        assert torch.equal(tensors[key], value.to(torch.float16)), key
    safetensors = pytest.importorskip("safetensors.torch")  # the reference reader, when installed
    loaded = safetensors.load_file(out)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_cli_prints_one_summary_line(saved, tmp_path, capsys):
    path, _ = saved
    assert main(["consolidate", str(path), str(tmp_path / "gpt.pt"), "--weights-only"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and out.startswith(f"Consolidated {path} (3 ranks) into {tmp_path / 'gpt.pt'}: ")
    assert err == ""  # no progress when stderr is not a terminal


def test_progress_on_a_terminal_shows_tensors_and_bytes_done_of_the_total():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    bar = ProgressBar(stream)
    bar(Progress(tensors_done=1, tensors_total=4, bytes_done=2**20, bytes_total=4 * 2**20))
    bar(Progress(tensors_done=4, tensors_total=4, bytes_done=4 * 2**20, bytes_total=4 * 2**20))
    bar.close()
    last = stream.getvalue().rstrip("\n").split("\r")[-1]  # tqdm rewrites its line in place
    assert last.startswith("consolidate: 100%") and "4.00M/4.00M" in last and "4/4 tensors" in last, last
    assert stream.getvalue().endswith("\n")


LAYERS, WIDTH = 12, 2048  # 12 parameters of 16 MiB: a 192 MiB output


def _save_large_model(rank: int, world_size: int, path: str) -> None:
    from lightning_zero3 import ShardedModel
    from lightning_zero3.checkpoint import save_sharded

    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    save_sharded(path, ShardedModel(model), {"state_dict": model.state_dict()})


# The command as `python -m lightning_zero3` runs it, in a fresh process that reports its peak
# RSS (VmHWM) before and after consolidating, so the imports (torch, lightning) are not counted
# as consolidation memory.
_MEASURED_CLI = """
import runpy, sys
def peak():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
import lightning_zero3  # torch and lightning: not consolidation memory
before = peak()
sys.argv = ["lightning_zero3", *sys.argv[1:]]
try:
    runpy.run_module("lightning_zero3", run_name="__main__")
except SystemExit as exit:
    code = exit.code
print(before, peak())
sys.exit(code)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_consolidation_peak_memory_is_about_one_parameter_not_the_output(tmp_path):
    path = tmp_path / "large.ckpt"
    run_ranks(_save_large_model, 2, str(path), timeout_s=120)
    out = tmp_path / "large.pt"
    result = subprocess.run(
        [sys.executable, "-c", _MEASURED_CLI, "consolidate", str(path), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.splitlines()[-1].split())
    parameter, output = WIDTH * WIDTH * 4, out.stat().st_size
    assert output > LAYERS * parameter
    growth = after - before
    mib = 2**20
    message = f"consolidating {output / mib:.0f} MiB of {parameter / mib:.0f} MiB tensors took {growth / mib:.0f} MiB"
    assert growth < 2.5 * parameter, message
    assert growth < output / 4, message


@pytest.mark.parametrize("failing", ["replace_path", "fsync"])
def test_a_failed_swap_or_sync_is_a_checkpoint_error_and_leaves_nothing(saved, tmp_path, monkeypatch, failing):
    """After the writing, the sync and the swap into place can fail too: the same CheckpointError
    as a failed write (not the bare OSError), and no file at the destination or under a temporary name."""
    from lightning_zero3.checkpoint import CheckpointError, files

    def fail(*args: object) -> None:
        raise OSError(5, "Input/output error")

    if failing == "fsync":
        monkeypatch.setattr(files.os, "fsync", fail)
    else:
        monkeypatch.setattr(files, failing, fail)
    out = tmp_path / "out" / "whole.ckpt"
    out.parent.mkdir()
    with pytest.raises(CheckpointError, match="whole.ckpt failed: OSError.*nothing was written there"):
        consolidate_checkpoint(saved[0], out)
    assert list(out.parent.iterdir()) == []
