"""HF `generate()` on a sharded model keeps the ranks in step without being told: outside
`gathered_for_inference()`, a call that leaves `synced_gpus` unset runs as with
`synced_gpus=True` (engine/generation.py, Note: synced generation by default). Code written for
DDP, where a rank that reaches EOS first simply stops, then works unchanged instead of leaving
the other ranks waiting in a gather until the collective timeout (30 minutes by default)."""

from __future__ import annotations

import pickle

import pytest

from lightning_zero3.engine import ShardedModel
from tests.engine.test_engine_generate import PROMPTS, _tokens, tiny_gpt2
from tests.support.ranks import run_ranks


def test_ranks_reaching_eos_at_different_steps_get_their_tokens_without_synced_gpus():
    pytest.importorskip("transformers")
    results = run_ranks(_tokens, 2, False, PROMPTS, None)  # synced_gpus left unset, as under DDP
    assert len(results[0]["expected"]) < len(results[1]["expected"]), "the prompts must stop at different steps"
    for result in results:
        assert result["got"] == result["expected"]
        assert result["alive"] == 0 and not result["shadowed"]


def _restored_module_is_plain(rank: int, world_size: int) -> dict:
    model = tiny_gpt2()
    sharded = ShardedModel(model)
    installed = "generate" in vars(model)
    sharded.restore_module(device="cpu")
    pickle.dumps(model)
    return {"installed": installed, "left": "generate" in vars(model)}


def test_the_default_is_removed_with_the_engine():
    pytest.importorskip("transformers")
    for result in run_ranks(_restored_module_is_plain, 2):
        assert result["installed"], "the engine should give generate() its synced default"
        assert not result["left"], "restore_module must leave an ordinary module"


def test_what_the_caller_passes_wins_and_the_default_applies_only_outside_the_context() -> None:
    """test_engine_generate.py relies on an explicit synced_gpus=False being kept."""
    from lightning_zero3.engine.generation import synced_default

    assert synced_default({"synced_gpus": False}, kept=False, world_size=2) == {"synced_gpus": False}
    assert synced_default({}, kept=False, world_size=2) == {"synced_gpus": True}
    assert synced_default({}, kept=True, world_size=2) == {}
    assert synced_default({"synced_gpus": None}, kept=False, world_size=1) == {"synced_gpus": None}
