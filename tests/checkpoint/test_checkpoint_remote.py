"""Checkpoints at `s3://` URLs, against a real S3 endpoint on this machine: moto's server on
127.0.0.1, through s3fs, with two ranks writing to one bucket (Note: remote checkpoints in
lightning_zero3/checkpoint/remote.py). Trainer runs are started by the strategy's launcher
(tests/support/adapted.py `launched`); the Fabric saves cut short on rank 0 (a kill, a raise) stay on the
harness's ranks: a rank is killed, or every rank must raise."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("s3fs", reason="the test extra installs s3fs and moto[server]")
moto_server = pytest.importorskip("moto.server", reason="the test extra installs s3fs and moto[server]")

import lightning_zero3  # noqa: E402
from lightning_zero3.checkpoint import CheckpointError, remove_checkpoint  # noqa: E402
from lightning_zero3.checkpoint.full import read_full_file  # noqa: E402
from tests.support.adapted import HandsBack, launched  # noqa: E402
from tests.support.lit import LitMLP, loader, max_difference, reference_fit, trainer  # noqa: E402
from tests.support.ranks import RankFailure, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow  # a local S3 server (moto) and 2-rank Trainer runs against it

TOL = 1e-5
STEPS_PER_EPOCH = 4
BUCKET = "ckpts"


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """moto's S3 server on 127.0.0.1 and a free port, a bucket, and the environment that points
    boto/s3fs at it (fake credentials); the server stops at the end of the module."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield env
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _read(url: str) -> bytes:
    import fsspec

    with fsspec.open(url, "rb") as f:
        return f.read()  # type: ignore[no-any-return]


def _objects(prefix: str) -> list[str]:
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


class _InEnvironment(pl.Callback):
    """Sets `env` in each rank at `setup`, before anything reads a URL: the forkserver's children
    do not see the test's environment."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        os.environ.update(self.env)


class _SavesFull(pl.Callback):
    """After `fit`, at rest (its `on_fit_end`, the strategy torn down): a full checkpoint at `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.lightning_options = dataclasses.replace(
            trainer.strategy.lightning_options, state_dict_type="full"
        )
        trainer.save_checkpoint(self.path)


@pytest.fixture(scope="module")
def saved(s3: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-rank fit that saved a sharded checkpoint (ModelCheckpoint) and a full one to S3, run
    from an empty working directory."""
    cwd = tmp_path_factory.mktemp("cwd")
    before = os.getcwd()
    os.chdir(cwd)
    try:
        url = f"s3://{BUCKET}/run"
        torch.manual_seed(0)
        callbacks = [
            _InEnvironment(s3),
            ModelCheckpoint(dirpath=url, filename="during_fit"),
            _SavesFull(f"{url}/full.ckpt"),
        ]
        trainer(launched("zero3"), 2, max_epochs=1, enable_checkpointing=True, callbacks=callbacks).fit(
            LitMLP(), loader(2)
        )
    finally:
        os.chdir(before)
    assert list(cwd.iterdir()) == []  # nothing local, e.g. no `s3:/ckpts/run` directory
    return f"s3://{BUCKET}/run"


def test_sharded_and_full_checkpoints_are_objects_in_the_bucket(saved):
    keys = _objects("run/")
    assert "run/full.ckpt" in keys
    assert "run/during_fit.ckpt/meta.json" in keys
    prefixes = {k.split("/")[2] for k in keys if k.startswith("run/during_fit.ckpt/shards.")}
    assert len(prefixes) == 1  # one save's prefix, named by meta.json
    (prefix,) = prefixes
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state.pt"):
        assert f"run/during_fit.ckpt/{prefix}/{name}" in keys
    assert not Path("s3:").exists()


@pytest.mark.parametrize("kind", ["during_fit", "full"])
def test_checkpoint_at_a_url_resumes_exactly_at_another_world_size(saved, s3, kind):
    torch.manual_seed(0)
    model = LitMLP()
    losses = reference_fit(model, epochs=2)
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    resumed = LitMLP()
    callbacks = [_InEnvironment(s3), HandsBack(losses="lightning_module.step_losses")]
    t = trainer(launched("zero3"), 1, max_epochs=2, callbacks=callbacks)
    t.fit(resumed, loader(1), ckpt_path=f"{saved}/{kind}.ckpt")
    (step_losses,), final = t.callback_metrics["losses"], resumed.state_dict()
    assert len(step_losses) == STEPS_PER_EPOCH  # only the second epoch ran
    assert max(abs(a - b) for a, b in zip(step_losses, losses[STEPS_PER_EPOCH:])) < TOL
    assert max_difference(final, model.state_dict()) < TOL


def test_load_checkpoint_consolidate_and_the_cli_read_a_url(saved, s3, tmp_path):
    full = lightning_zero3.load_checkpoint(f"{saved}/full.ckpt")
    sharded = lightning_zero3.load_checkpoint(f"{saved}/during_fit.ckpt")
    assert max_difference(sharded["state_dict"], full["state_dict"]) == 0
    model = lightning_zero3.load_from_checkpoint(LitMLP, f"{saved}/during_fit.ckpt")
    assert max_difference(model.state_dict(), full["state_dict"]) == 0
    cli = [sys.executable, "-m", "lightning_zero3", "consolidate", f"{saved}/during_fit.ckpt", f"{saved}/out.ckpt"]
    subprocess.run(cli, check=True, env={**os.environ, **s3}, capture_output=True, cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []
    out = lightning_zero3.load_checkpoint(f"{saved}/out.ckpt")
    assert max_difference(out["state_dict"], full["state_dict"]) == 0
    # Streamed to the store (each record's size after its data), it still memory-maps once downloaded.
    (tmp_path / "out.ckpt").write_bytes(_read(f"{saved}/out.ckpt"))
    mapped = torch.load(tmp_path / "out.ckpt", mmap=True, weights_only=True)
    assert max_difference(mapped["state_dict"], full["state_dict"]) == 0
    remove_checkpoint(f"{saved}/out.ckpt")
    assert "run/out.ckpt" not in _objects("run/")


# ---- saves cut short: the previous checkpoint stays, the partial one is refused ---------------
def _fabric_save_twice(rank: int, world_size: int, env: dict[str, str], url: str, kind: str, cut: str) -> None:
    """Save (A) to `url`, one step, then save again (B), cut short on rank 0 by `cut` ("kill",
    "raise"; "kill in the background": with `async_save`, in the thread writing B)."""
    os.environ.update(env)
    from tests.support.fabric_helpers import adamw, fabric, train_step
    from tests.support.models import MLP

    background = cut == "kill in the background"
    strategy = lightning_zero3.ZeRO3FabricStrategy(state_dict_type=kind, async_save=background)
    f = fabric(rank, world_size, strategy)
    torch.manual_seed(0)
    module = MLP()
    model, optimizer = f.setup(module, adamw(module))
    f.save(url, {"model": model, "optimizer": optimizer})
    train_step(f, model, optimizer, 0, rank, world_size, None)
    if rank == 0:
        _cut_on_rank_0(kind, "kill" if background else cut, skip=1 if background else 0)  # A may be writing still
    f.save(url, {"model": model, "optimizer": optimizer})
    strategy.teardown()  # waits for a save in the background


def _cut_on_rank_0(kind: str, cut: str, skip: int = 0) -> None:
    """Sharded: rank 0 dies (kill -9) or raises as it commits meta.json (after the first `skip`
    commits), after every shard is uploaded. Full: rank 0 raises in the middle of uploading the file."""
    from lightning_zero3.checkpoint import save

    commit, calls = save.write_json_atomically, []

    def die(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) <= skip:
            return commit(*args, **kwargs)
        if cut == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError("injected failure")

    def half_a_file(obj: Any, stream: Any) -> None:
        stream.write(b"PK\x03\x04" + bytes(1 << 20))
        raise OSError("injected failure in the middle of the upload")

    if kind == "sharded":
        save.write_json_atomically = die  # type: ignore[assignment]
    else:
        torch.save = half_a_file  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("kind", "cut"),
    [("sharded", "kill"), ("sharded", "kill in the background"), ("sharded", "raise"), ("full", "raise")],
)
def test_a_save_cut_short_leaves_the_previous_checkpoint(s3, kind, cut):
    url = f"s3://{BUCKET}/cut-{kind}-{cut.replace(' ', '-')}"
    with pytest.raises(RankFailure, match="injected failure" if cut == "raise" else "without reporting"):
        run_ranks(_fabric_save_twice, 2, s3, url, kind, cut)
    from tests.support.models import MLP

    torch.manual_seed(0)
    initial = MLP()
    # A: the weights before the step
    state = (
        lightning_zero3.load_checkpoint(url)["state_dict"]
        if kind == "sharded"
        else read_full_file(url, key="model", trusted=False)["model"]
    )
    assert max_difference(state, initial.state_dict()) == 0
    if kind == "sharded":
        shards = {k.split("/")[1] for k in _objects(url.removeprefix(f"s3://{BUCKET}/") + "/") if "/shards." in k}
        assert len(shards) == (1 if cut == "raise" else 2)  # B's prefix stays after a kill, unnamed


def test_a_first_save_killed_before_its_manifest_is_refused(s3):
    url = f"s3://{BUCKET}/first-killed"
    with pytest.raises(RankFailure):
        run_ranks(_killed_first_save, 2, s3, url)
    assert any(k.endswith("__1_0.distcp") for k in _objects("first-killed/"))
    with pytest.raises(CheckpointError, match="has shard files but no meta.json"):
        lightning_zero3.load_checkpoint(url)


def _killed_first_save(rank: int, world_size: int, env: dict[str, str], url: str) -> None:
    os.environ.update(env)
    from tests.support.fabric_helpers import adamw, fabric
    from tests.support.models import MLP

    f = fabric(rank, world_size, lightning_zero3.ZeRO3FabricStrategy())
    module = MLP()
    model, optimizer = f.setup(module, adamw(module))
    if rank == 0:
        _cut_on_rank_0("sharded", "kill")
    f.save(url, {"model": model, "optimizer": optimizer})


def _save_with_part_uploads_failing_on_rank_1(rank: int, world_size: int, env: dict[str, str], url: str) -> str:
    """A sharded save of 8 MiB of shards per rank to `url`, uploaded in parts of 5 MiB (S3's
    smallest), every part upload failing on rank 1 after its multipart upload began; the error."""
    os.environ.update(env)
    import s3fs

    from lightning_zero3 import ShardedModel
    from lightning_zero3.checkpoint import save_sharded

    s3fs.S3FileSystem.default_block_size = 5 * 2**20
    if rank == 1:

        def refuse(self: Any, final: bool = False) -> None:
            raise OSError("injected: a part upload failed")

        s3fs.core.S3File._upload_chunk = refuse
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048))
    sharded = ShardedModel(model)
    with pytest.raises(CheckpointError) as raised:
        save_sharded(url, sharded, {"state_dict": model.state_dict()})
    return str(raised.value)


def test_a_failed_upload_leaves_no_open_multipart_upload(s3):
    import boto3

    errors = run_ranks(_save_with_part_uploads_failing_on_rank_1, 2, s3, f"s3://{BUCKET}/failed-upload")
    assert all("injected: a part upload failed" in error for error in errors), errors
    assert boto3.client("s3").list_multipart_uploads(Bucket=BUCKET, Prefix="failed-upload/").get("Uploads", []) == []
    assert _objects("failed-upload/") == []


def test_a_remote_path_reprs_as_its_url():
    """A URL in a repr (`ConsolidationSummary`'s, an assertion's) reads as the URL, not an object id."""
    from lightning_zero3.checkpoint.remote import as_path

    path = as_path("memory://bucket/ck")
    assert repr(path) == f"RemotePath({str(path)!r})" and "bucket/ck" in repr(path)
