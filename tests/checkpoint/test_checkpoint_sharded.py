"""Sharded checkpoints on the bare engine: every rank writes only its shards, and a checkpoint
loads exactly (parameters, optimizer state, param groups) at any world size."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

import lightning_zero3
from lightning_zero3 import ShardedModel
from lightning_zero3 import checkpoint as ckpt
from lightning_zero3.checkpoint.load import open_checked
from tests.support.checkpoints import load_into_fresh_gpt, save_trained_gpt, trained_gpt
from tests.support.models import MLP, TinyGPT
from tests.support.ranks import run_ranks


def assert_same_state(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    (model, optim), (ref_model, ref_optim) = got, expected
    assert list(model) == list(ref_model)
    for key in ref_model:
        assert torch.equal(model[key], ref_model[key]), key
    assert optim["param_groups"] == ref_optim["param_groups"]
    assert optim["state"].keys() == ref_optim["state"].keys()
    for index, entry in ref_optim["state"].items():
        for key, value in entry.items():
            assert torch.equal(optim["state"][index][key], value), (index, key)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_checkpoint_from_2_ranks_loads_exactly_at_1_2_and_3_ranks(gpt_saved_at_2, world_size):
    path, expected = gpt_saved_at_2
    for rank_result in run_ranks(load_into_fresh_gpt, world_size, str(path)):
        model, optim, extra = rank_result
        assert_same_state((model, optim), expected)
        assert extra == {"epoch": 3, "note": "kept"}


@pytest.mark.slow
def test_checkpoint_from_3_ranks_loads_exactly_at_2(tmp_path):
    path = str(tmp_path / "gpt.ckpt")
    expected = run_ranks(save_trained_gpt, 3, path)[0]
    assert_same_state(run_ranks(load_into_fresh_gpt, 2, path)[0][:2], expected)


@pytest.mark.slow
def test_one_process_without_a_process_group_saves_and_loads(tmp_path):
    path = tmp_path / "gpt.ckpt"
    expected = save_trained_gpt(0, 1, str(path))
    assert_same_state(load_into_fresh_gpt(0, 1, str(path))[:2], expected)


@pytest.mark.slow
def test_parameters_kept_whole_in_one_run_load_as_shards_in_another(tmp_path):
    """A different persistence_threshold: small parameters saved whole load into shards, and back."""
    whole = str(tmp_path / "whole.ckpt")
    expected, stepped = run_ranks(save_trained_gpt, 2, whole, 100, None, True)[0]
    loaded = run_ranks(load_into_fresh_gpt, 3, whole)[0][:2]
    assert_same_state(loaded, expected)
    # The loaded optimizer state serves the next step as it served the saving run's.
    (model, optim), (ref_model, ref_optim) = run_ranks(load_into_fresh_gpt, 3, whole, 0, None, True)[0][:2], stepped
    for key in ref_model:
        torch.testing.assert_close(model[key], ref_model[key], rtol=1e-5, atol=1e-6, msg=key)
    for index, entry in ref_optim["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(optim["state"][index][key], value, rtol=1e-5, atol=1e-6)
    sharded = str(tmp_path / "sharded.ckpt")
    expected = run_ranks(save_trained_gpt, 2, sharded)[0]
    assert_same_state(run_ranks(load_into_fresh_gpt, 2, sharded, 100)[0][:2], expected)


@pytest.mark.slow
def test_hierarchical_sharding_saves_each_chunk_once_and_loads_at_any_layout(tmp_path):
    """4 ranks as 2 shard groups of 2: the two groups hold the same shards, written once; the
    checkpoint loads at 3 ranks, and a 3-rank one loads into 2 groups of 2."""
    hybrid = str(tmp_path / "hybrid.ckpt")
    expected = run_ranks(save_trained_gpt, 4, hybrid, 0, 2)[0]
    meta = json.loads(Path(hybrid, "meta.json").read_text())
    assert (meta["world_size"], meta["shard_size"]) == (4, 2)
    import torch.distributed.checkpoint as dcp

    chunks = dcp.FileSystemReader(hybrid).read_metadata().state_dict_metadata["state_dict/wte.weight"].chunks
    assert [(c.offsets[0], c.sizes[0]) for c in chunks] == [(0, 296), (296, 296)]
    assert_same_state(run_ranks(load_into_fresh_gpt, 3, hybrid)[0][:2], expected)
    plain = str(tmp_path / "plain.ckpt")
    expected = run_ranks(save_trained_gpt, 3, plain)[0]
    for result in run_ranks(load_into_fresh_gpt, 4, plain, 0, 2):
        assert_same_state(result[:2], expected)


def test_directory_holds_meta_json_and_one_shard_file_per_rank(gpt_saved_at_2):
    path, _ = gpt_saved_at_2
    names = sorted(os.listdir(path))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "trainer_state.pt"]
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == "lightning_zero3.sharded" and meta["format_version"] == 1
    assert meta["world_size"] == 2
    assert meta["parameters"]["blocks.0.mlp.0.weight"] == {"shape": [64, 16], "dtype": "float32"}
    assert meta["fingerprint"].startswith("sha256:")
    entries = {e["key"]: e for e in meta["state_dict"]}
    assert entries["lm_head.weight"] == {"key": "lm_head.weight", "kind": "alias", "of": "wte.weight"}  # tied: once
    assert entries["wte.weight"]["kind"] == "sharded" and entries["wte.weight"]["shape"] == [37, 16]
    assert {f["rank"] for f in meta["files"].values() if "rank" in f} == {0, 1}
    assert all(len(f["crc32"]) == 8 for f in meta["files"].values())


def test_shards_are_stored_with_their_global_offsets(gpt_saved_at_2):
    """Each rank's piece is a chunk at offset r * ceil(numel / N) of the flattened parameter."""
    path, _ = gpt_saved_at_2
    import torch.distributed.checkpoint as dcp

    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    chunks = index["state_dict/wte.weight"].chunks  # 37 * 16 = 592 elements over 2 ranks
    assert [(c.offsets[0], c.sizes[0]) for c in chunks] == [(0, 296), (296, 296)]
    exp_avg = index["optimizer_states/0/blocks.0.ln1.bias/exp_avg"]
    assert tuple(exp_avg.size) == (16,) and len(exp_avg.chunks) == 2


def _gathers_during_save(rank: int, world_size: int, path: str) -> int:
    model, sharded, optimizer = trained_gpt()
    before = sharded.stats.shard_group.current["all_gather"].calls
    optimizer_states = [ckpt.sharded_optimizer_state(sharded, optimizer)]
    ckpt.save_sharded(path, sharded, {"state_dict": model.state_dict(), "optimizer_states": optimizer_states})
    return sharded.stats.shard_group.current["all_gather"].calls - before


def test_saving_gathers_no_parameter(tmp_path):
    assert run_ranks(_gathers_during_save, 2, str(tmp_path / "gpt.ckpt")) == [0, 0]


def test_checkpoint_modules_never_import_lightning():
    files = sorted((Path(lightning_zero3.__file__).parent / "checkpoint").glob("*.py"))
    assert len(files) >= 6
    for name in files:
        tree = ast.parse(name.read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in imported if m.split(".")[0] in {"lightning", "pytorch_lightning"}], name


def _load_into_a_deeper_gpt(rank: int, world_size: int, path: str) -> tuple[dict, dict]:
    torch.manual_seed(1)
    model = TinyGPT(depth=3)
    sharded = ShardedModel(model)
    untouched = {k: v.clone() for k, v in sharded.full_state_dict(to_rank=None).items() if k.startswith("blocks.2.")}
    ckpt.load_sharded(path, sharded, strict=False)
    return sharded.full_state_dict(to_rank=None), untouched


def test_strict_false_loads_the_keys_both_models_have_and_keeps_the_rest(gpt_saved_at_2):
    path, (expected, _) = gpt_saved_at_2
    loaded, untouched = run_ranks(_load_into_a_deeper_gpt, 2, str(path))[0]
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    for key, value in untouched.items():
        assert torch.equal(loaded[key], value), key


def test_a_model_of_another_shape_is_refused_naming_the_difference(gpt_saved_at_2):
    path, _ = gpt_saved_at_2
    with pytest.raises(ckpt.CheckpointError) as refused:
        open_checked(path, ShardedModel(MLP()), strict=True, context="Cannot load", trusted=False)
    problem = str(refused.value)
    assert str(path) in problem and "not in the checkpoint" in problem and "'blocks.0.fc1.weight'" in problem
    wider = r"'wte.weight' has shape \(37, 16\) in the checkpoint but \(37, 24\) in the model"
    with pytest.raises(ckpt.CheckpointError, match=wider):
        open_checked(path, ShardedModel(TinyGPT(dim=24)), strict=False, context="Cannot load", trusted=False)
