"""Loading never runs code from a checkpoint and never touches a file outside it (Note: checkpoint
trust model): a crafted pickle in DCP's `.metadata` or in `trainer_state.pt` is refused, unrun, by
every loader (engine, `fit`/`validate(ckpt_path=)`, consolidate) with a `CheckpointError` naming
the file and the forbidden global; file names in meta.json and in the index must be plain names
inside the directory; a hand-edited meta.json is a `CheckpointError`, not a TypeError.
`trust_checkpoint=True` / `--trust-checkpoint` restores plain unpickling. Trainer runs are started
by the strategy's launcher (tests/support/adapted.py `launched`)."""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from lightning_zero3 import ShardedModel
from lightning_zero3 import checkpoint as ckpt
from lightning_zero3.__main__ import main
from lightning_zero3.checkpoint.files import crc32
from tests.support.adapted import HandsBack, SavesAfterFit, launched
from tests.support.checkpoints import save_mlp
from tests.support.lit import LitMLP, loader, trainer
from tests.support.models import MLP


# ---- helpers (also used by test_checkpoint_overwrite.py) ------------------------------------
def load_mlp(path: Path, **options: Any) -> dict[str, Any]:
    model = MLP()
    sharded = ShardedModel(model)
    return ckpt.load_sharded(path, sharded, optimizers=[torch.optim.AdamW(model.parameters())], **options)


def edit_meta(path: Path, edit: Any) -> None:
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def plant(path: Path, name: str, data: bytes) -> None:
    """Replace a file of the checkpoint and record its new size and CRC-32 in meta.json, as
    someone crafting a checkpoint would: the checksums then prove nothing about its source."""
    (path / name).write_bytes(data)
    edit_meta(path, lambda meta: meta["files"].__setitem__(name, {"bytes": len(data), "crc32": crc32(path / name)}))


class CreatesAFile:
    """Unpickling this calls `open(path, "w")`: a stand-in for any code a crafted pickle runs."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> Any:
        return open, (self.path, "w")


def craft(path: Path, name: str, marker: Path) -> None:
    """Put a payload that creates `marker` into the checkpoint's `.metadata` or `trainer_state.pt`,
    keeping the rest of the file valid."""
    if name == ".metadata":
        index = pickle.loads((path / name).read_bytes())
        index.planner_data = {"note": CreatesAFile(marker)}
        plant(path, name, pickle.dumps(index))
    else:
        state = torch.load(path / name, weights_only=False)
        state["extra"]["note"] = CreatesAFile(marker)
        torch.save(state, path / name)
        plant(path, name, (path / name).read_bytes())


FORBIDDEN = {".metadata": "io.open", "trainer_state.pt": "io.open"}


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlp") / "mlp.ckpt"
    save_mlp(path)
    return path


@pytest.fixture
def copy(mlp: Path, tmp_path: Path) -> Path:
    path = tmp_path / "mlp.ckpt"
    shutil.copytree(mlp, path)
    return path


# ---- crafted pickles ------------------------------------------------------------------------
@pytest.mark.parametrize("name", [".metadata", "trainer_state.pt"])
def test_a_crafted_pickle_is_refused_unrun_by_load_sharded(copy, tmp_path, name):
    marker = tmp_path / "payload_ran"
    craft(copy, name, marker)
    with pytest.raises(ckpt.CheckpointError) as raised:
        load_mlp(copy)
    assert str(copy / name) in str(raised.value) and FORBIDDEN[name] in str(raised.value)
    assert "trust_checkpoint=True" in str(raised.value)
    assert not marker.exists()


@pytest.mark.parametrize("name", [".metadata", "trainer_state.pt"])
def test_a_crafted_pickle_is_refused_unrun_by_the_consolidate_cli(copy, tmp_path, capsys, name):
    marker = tmp_path / "payload_ran"
    craft(copy, name, marker)
    assert main(["consolidate", str(copy), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(copy / name) in err and FORBIDDEN[name] in err
    assert "--trust-checkpoint" in err
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_trust_checkpoint_unpickles_as_before(copy, tmp_path, capsys):
    """The opt-in restores plain pickle: the payload runs (that is what trusting means)."""
    marker = tmp_path / "payload_ran"
    craft(copy, ".metadata", marker)
    assert main(["consolidate", str(copy), str(tmp_path / "out.pt"), "--trust-checkpoint"]) == 0
    assert marker.exists()
    load_mlp(copy, trusted=True)


def test_an_index_with_byte_items_is_refused(copy):
    """DCP loads byte items with torch.load(weights_only=False); our format never writes them."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    index = pickle.loads((copy / ".metadata").read_bytes())
    key = next(iter(index.state_dict_metadata))
    index.state_dict_metadata[key] = BytesStorageMetadata()
    plant(copy, ".metadata", pickle.dumps(index))
    with pytest.raises(ckpt.CheckpointError, match="BytesStorageMetadata"):
        load_mlp(copy)


def _load_crafted_under_lightning(directory: Path) -> dict[str, Any]:
    """Fit one step and save; then, for a payload in each pickle, `fit` and `validate` with
    ckpt_path= on a crafted copy: the error each raised (the failed rank's traceback), and whether
    the payload ran. Every run is started by the strategy's launcher."""
    saved = directory / "mlp.ckpt"
    trainer(launched("zero3"), 1, max_steps=1, callbacks=[SavesAfterFit(saved)]).fit(LitMLP(), loader(1))
    results = {}
    for name in (".metadata", "trainer_state.pt"):
        crafted, marker = directory / f"crafted{name}", directory / f"ran{name}"
        shutil.copytree(saved, crafted)
        craft(crafted, name, marker)
        for entry in ("fit", "validate"):
            t = trainer(launched("zero3"), 1, max_epochs=2)
            try:
                getattr(t, entry)(LitMLP(), loader(1), ckpt_path=crafted)
                error = None
            except ProcessRaisedException as err:
                error = str(err)
            results[(name, entry)] = (error, str(crafted / name), marker.exists())
    t = trainer(launched("zero3", trust_checkpoint=True), 1, max_epochs=2, callbacks=[HandsBack(steps="global_step")])
    t.fit(LitMLP(), loader(1), ckpt_path=directory / "crafted.metadata")
    results["trusted"] = (t.callback_metrics["steps"][0], (directory / "ran.metadata").exists())
    return results


@pytest.fixture(scope="module")
def lightning_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _load_crafted_under_lightning(tmp_path_factory.mktemp("lightning"))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["fit", "validate"])
@pytest.mark.parametrize("name", [".metadata", "trainer_state.pt"])
def test_a_crafted_pickle_is_refused_unrun_by_ckpt_path(lightning_loads, name, entry):
    error, file, ran = lightning_loads[(name, entry)]
    assert error is not None and f"{ckpt.CheckpointError.__module__}.CheckpointError: " in error
    assert file in error and FORBIDDEN[name] in error
    assert not ran


@pytest.mark.slow
def test_trust_checkpoint_on_the_strategy_unpickles_as_before(lightning_loads):
    steps, ran = lightning_loads["trusted"]
    assert ran and 1 < steps < 8  # trained on from the checkpoint (a fresh run takes 8 steps)


# ---- file names -----------------------------------------------------------------------------
@contextmanager
def touches_of(secret: Path) -> Iterator[list[str]]:
    """Record every stat, lstat and open (os.stat, os.lstat, os.open, open) that reaches the
    file `secret`, by whatever path or link: its inode is compared, not its name."""
    target = os.stat(secret)
    touched: list[str] = []
    stat, lstat, os_open, builtin_open = os.stat, os.lstat, os.open, builtins.open

    def check(kind: str, path: Any, result: os.stat_result) -> None:
        if (result.st_dev, result.st_ino) == (target.st_dev, target.st_ino):
            touched.append(f"{kind}({os.fspath(path) if not isinstance(path, int) else path!r})")

    def recording_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = stat(path, *args, **kwargs)
        check("lstat" if kwargs.get("follow_symlinks") is False else "stat", path, result)
        return result

    def recording_lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = lstat(path, *args, **kwargs)
        check("lstat", path, result)
        return result

    def recording_os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        fd = os_open(path, *args, **kwargs)
        check("os.open", path, os.fstat(fd))
        return fd

    def recording_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        f = builtin_open(file, *args, **kwargs)
        check("open", file, os.fstat(f.fileno()))
        return f

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "stat", recording_stat)
        patch.setattr(os, "lstat", recording_lstat)
        patch.setattr(os, "open", recording_os_open)
        patch.setattr(builtins, "open", recording_open)
        patch.setattr(io, "open", recording_open)
        yield touched


def test_the_recorder_sees_a_stat_through_a_link(tmp_path):
    """The guard of the test below: a stat that follows a link to the secret is recorded."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x")
    (tmp_path / "link").symlink_to(secret)
    with touches_of(secret) as touched:
        (tmp_path / "link").is_symlink()  # lstat of the link itself: not the secret
        assert touched == []
        (tmp_path / "link").resolve()
        (tmp_path / "link").stat()
    assert len(touched) >= 2, touched


@pytest.mark.parametrize("kind", ["parent", "absolute", "separator", "link"])
def test_a_file_name_leading_outside_the_checkpoint_is_refused_before_it_is_touched(copy, tmp_path, kind):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 4321)
    name = {"parent": "../secret.bin", "absolute": str(secret), "separator": "sub/secret.bin", "link": "link"}[kind]
    (copy / "sub").mkdir()
    (copy / "sub" / "secret.bin").symlink_to(secret)
    (copy / "link").symlink_to(secret)
    edit_meta(copy, lambda meta: meta["files"].__setitem__(name, {"bytes": 1, "crc32": "00000000"}))
    with touches_of(secret) as touched, pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.consolidate_checkpoint(copy, tmp_path / "out.pt")
    message = str(raised.value)
    assert repr(name) in message and "meta.json" in message
    assert touched == []  # the outside file was not even stat'ed


def test_a_dcp_index_naming_a_file_outside_the_checkpoint_is_refused(copy, tmp_path):
    (tmp_path / "secret.bin").write_bytes(b"x" * 4321)
    index = pickle.loads((copy / ".metadata").read_bytes())
    for info in index.storage_data.values():
        info.relative_path = "../secret.bin"
    plant(copy, ".metadata", pickle.dumps(index))
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata is not a valid checkpoint: '\.\./secret\.bin'"):
        load_mlp(copy)


# ---- hand-edited meta.json ------------------------------------------------------------------
EDITS = {
    "files as a list": (lambda m: m.__setitem__("files", sorted(m["files"])), "'files' must be an object"),
    "a file without crc32": (lambda m: next(iter(m["files"].values())).pop("crc32"), "'bytes' .an integer. and"),
    "world_size a string": (lambda m: m.__setitem__("world_size", "2"), "'world_size' must be a positive integer"),
    "an entry without kind": (lambda m: m["state_dict"][0].pop("kind"), r"'state_dict'\[0\] must be an object"),
    "a shape of strings": (lambda m: m["state_dict"][0].__setitem__("shape", ["3"]), r"\['shape'\] must be a list"),
    "optimizer state as a list": (
        lambda m: m["optimizers"][0].__setitem__("state", []),
        r"'optimizers'\[0\]\['state'\] must be an object of objects",
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_hand_edited_meta_json_is_a_checkpoint_error_naming_the_file(copy, tmp_path, edit):
    change, match = EDITS[edit]
    edit_meta(copy, change)
    with pytest.raises(ckpt.CheckpointError, match=match) as raised:
        load_mlp(copy)
    assert f"{copy / 'meta.json'} is corrupted" in str(raised.value)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.consolidate_checkpoint(copy, tmp_path / "out.pt")


def test_a_trainer_state_without_its_entries_is_a_checkpoint_error(copy):
    torch.save({"extra": {}}, copy / "trainer_state.pt")
    plant(copy, "trainer_state.pt", (copy / "trainer_state.pt").read_bytes())
    with pytest.raises(ckpt.CheckpointError, match="trainer_state.pt is corrupted: it is not the dict"):
        load_mlp(copy)


# ---- what a crafted or damaged file may not do -------------------------------------------------
@pytest.mark.parametrize(
    ("module", "cls", "attribute"),
    [("pathlib", "PosixPath", "zero3_crafted"), ("torch.distributed.checkpoint.metadata", "Metadata", "version")],
)
def test_an_index_setting_attributes_of_a_class_is_refused_and_changes_nothing(copy, tmp_path, module, cls, attribute):
    """pickle's BUILD on an admitted class (not an instance) would set a class attribute for
    the rest of the process: refused, the class unchanged."""
    target = getattr(__import__(module, fromlist=[cls]), cls)
    before = target.__dict__.get(attribute, "absent")
    name = attribute.encode()
    build = b"c" + module.encode() + b"\n" + cls.encode() + b"\nN}X" + len(name).to_bytes(4, "little") + name
    build += b"X\x07\x00\x00\x00crafteds\x86b0"  # (None, {attribute: "crafted"}) BUILD, POP
    index = pickle.dumps(pickle.loads((copy / ".metadata").read_bytes()), protocol=2)
    plant(copy, ".metadata", index[:2] + build + index[2:])  # the index itself is intact
    try:
        with pytest.raises(ckpt.CheckpointError, match=f"sets the attributes \\['{attribute}'\\] of the class {cls}"):
            ckpt.consolidate_checkpoint(copy, tmp_path / "out.pt")
        assert target.__dict__.get(attribute, "absent") == before
    finally:
        if before != "absent":
            setattr(target, attribute, before)
        elif attribute in target.__dict__:
            delattr(target, attribute)


def test_a_meta_json_linking_outside_the_checkpoint_is_refused_unread(copy, tmp_path):
    outside = tmp_path / "elsewhere" / "meta.json"
    outside.parent.mkdir()
    (copy / "meta.json").rename(outside)
    (copy / "meta.json").symlink_to(outside)
    with touches_of(outside) as touched, pytest.raises(ckpt.CheckpointError, match="'meta.json' is a link to"):
        ckpt.consolidate_checkpoint(copy, tmp_path / "out.pt")
    assert touched == []


class RunsACommand:
    def __reduce__(self) -> Any:
        return os.system, ("true",)


def test_a_full_file_naming_a_blocked_global_gets_the_trust_hint(tmp_path):
    """torch 2.13 words a global of a blocked module ("Trying to load unsupported GLOBAL
    os.system whose module os is blocked") unlike other globals; both get the hint."""
    torch.save({"state_dict": {}, "note": RunsACommand()}, tmp_path / "full.ckpt")
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.load_checkpoint(tmp_path / "full.ckpt")
    assert "refers to the global 'posix.system'" in str(raised.value) or "'os.system'" in str(raised.value)
    assert "trust_checkpoint=True" in str(raised.value)


def test_a_truncated_full_file_is_named_truncated(tmp_path):
    save_mlp(tmp_path / "mlp.ckpt")
    full = ckpt.consolidate_checkpoint(tmp_path / "mlp.ckpt", tmp_path / "full.ckpt").dst
    data = full.read_bytes()
    full.write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match=f"{full} is truncated or damaged"):
        ckpt.load_checkpoint(full)


@pytest.mark.slow
def test_a_truncated_pickle_is_named_truncated_never_an_empty_reason(tmp_path):
    """A full file in torch's legacy (non-zip) format, cut at every length: pickle's EOFError,
    often without a message, reads "truncated", never "EOFError: " and nothing."""
    full = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": {"w": torch.randn(4, 4)}, "epoch": 1}, full, _use_new_zipfile_serialization=False)
    data, reasons = full.read_bytes(), []
    for length in range(1, len(data)):
        full.write_bytes(data[:length])
        with pytest.raises(ckpt.CheckpointError) as raised:
            ckpt.load_checkpoint(full)
        reasons.append(str(raised.value))
    assert not [r for r in reasons if r.rstrip().endswith(":")], "an empty reason"
    eof = [r for r in reasons if "EOFError" in r]
    assert eof and all("the file is truncated" in r for r in eof), eof[:2]


@pytest.mark.parametrize(("name", "admitted"), [("version", True), ("zero3_crafted", False)])
def test_an_index_build_state_of_a_dict_subclass_is_checked_by_its_keys(name, admitted):
    """pickle's BUILD with an OrderedDict state on an admitted instance: its keys are the names
    checked, as for a dict (a field is set; anything else is refused naming it, not a TypeError)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from lightning_zero3.checkpoint.trust import RestrictedUnpickler

    key = name.encode()
    data = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81"  # an instance, no __init__
    data += b"ccollections\nOrderedDict\n)RX" + len(key).to_bytes(4, "little") + key + b"X\x01\x00\x00\x00vsb."
    load = RestrictedUnpickler(io.BytesIO(data), source="crafted").load
    if admitted:
        index = load()
        assert isinstance(index, Metadata) and index.version == "v"
    else:
        with pytest.raises(ckpt.CheckpointError, match=r"sets the attributes \['zero3_crafted'\] of a Metadata"):
            load()
