"""HF `generate()` on a sharded model: the default path (every token gathers every unit) and
`ShardedModel.gathered_for_inference()` (units held gathered, no collective per token), ranks
whose sequences end at different steps, and what the context leaves behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero3.engine import ShardedModel
from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, dataset, trainer
from tests.support.models import MLP, mlp_batch
from tests.support.parity import max_param_difference, step_side_by_side
from tests.support.ranks import run_ranks

# Greedy continuations of the tiny GPT-2 below (seed 0): prompt [1, 2, 3] gives 3, 3, 11, ...
# and stops at EOS=11 after three tokens; prompt [4, 5, 6] never produces 11 in 12 tokens.
EOS = 11
PROMPTS = {0: [1, 2, 3], 1: [4, 5, 6]}
SAME_PROMPT = [4, 5, 6]


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=37, n_positions=64, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _shadowed(model: nn.Module) -> list[str]:
    return [f"{name}.{attr}" for name, m in model.named_modules() for attr in m._parameters if attr in m.__dict__]


def _generate(model: nn.Module, prompt: list[int], **options: object) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False, **options)
    return out[0].tolist()


def _gathers(sharded: ShardedModel) -> int:
    return sharded.stats.shard_group.current["all_gather"].calls


def _tokens(rank: int, world_size: int, held: bool, prompts: dict[int, list[int]], synced: bool | None) -> dict:
    torch.manual_seed(0)
    reference = tiny_gpt2()
    torch.manual_seed(0)
    model = tiny_gpt2()
    sharded = ShardedModel(model)
    options = {} if synced is None else {"synced_gpus": synced}
    before = _gathers(sharded)
    if held:
        with sharded.gathered_for_inference():
            entered = _gathers(sharded)
            got = _generate(model, prompts[rank], **options)
            inside = _gathers(sharded) - entered
    else:
        got, inside = _generate(model, prompts[rank], **options), None
    return {
        "got": got,
        "expected": _generate(reference, prompts[rank]),
        "gathers_inside": inside,
        "gathers": _gathers(sharded) - before,
        "alive": sharded.stats.units.alive,
        "shadowed": _shadowed(model),
    }


@pytest.mark.parametrize("held", [False, True], ids=["default", "gathered_for_inference"])
def test_greedy_generate_gives_the_single_process_tokens(held: bool):
    pytest.importorskip("transformers")
    for result in run_ranks(_tokens, 2, held, {0: SAME_PROMPT, 1: SAME_PROMPT}, None):
        assert result["got"] == result["expected"]
        assert len(result["got"]) == len(SAME_PROMPT) + 12, "the prompt should not reach EOS"
        assert result["alive"] == 0 and not result["shadowed"], "a unit is still gathered after generate"


def test_gathered_for_inference_issues_no_collective_per_token():
    """Three units (root + two blocks) gathered once on entry, nothing while generating."""
    pytest.importorskip("transformers")
    for result in run_ranks(_tokens, 2, True, {0: SAME_PROMPT, 1: SAME_PROMPT}, None):
        assert result["gathers_inside"] == 0
        assert result["gathers"] == 3


def test_ranks_reaching_eos_at_different_steps_with_synced_gpus_get_their_tokens():
    pytest.importorskip("transformers")
    results = run_ranks(_tokens, 2, False, PROMPTS, True)
    assert len(results[0]["expected"]) < len(results[1]["expected"]), "the prompts must stop at different steps"
    for result in results:
        assert result["got"] == result["expected"]


def test_ranks_reaching_eos_at_different_steps_inside_gathered_for_inference_need_no_sync():
    """A rank that stops early issues no collective the others wait for."""
    pytest.importorskip("transformers")
    results = run_ranks(_tokens, 2, True, PROMPTS, False)
    assert len(results[0]["expected"]) < len(results[1]["expected"]), "the prompts must stop at different steps"
    for result in results:
        assert result["got"] == result["expected"]
        assert result["alive"] == 0 and not result["shadowed"]


def _one_rank_generates(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = tiny_gpt2()
    torch.manual_seed(0)
    model = tiny_gpt2()
    sharded = ShardedModel(model)
    from transformers.integrations import is_fsdp_managed_module

    with sharded.gathered_for_inference():
        got = _generate(model, SAME_PROMPT) if rank == 0 else None  # synced_gpus left to HF
    return {"got": got, "expected": _generate(reference, SAME_PROMPT), "fsdp": is_fsdp_managed_module(model)}


def test_hf_does_not_sync_a_sharded_model_so_one_rank_can_generate_inside_gathered_for_inference():
    """The decision behind "pass synced_gpus=True outside the context" (user-guide.md): the
    engine does not mark modules `_is_fsdp_managed_module`, HF's cue for turning synced_gpus on.
    Marked, HF would All-Reduce a flag per token on the one rank sampling text for a log, which
    waits for the others until the timeout; and dynamo would stop compiling the model (docs)."""
    pytest.importorskip("transformers")
    results = run_ranks(_one_rank_generates, 2)
    assert results[0]["got"] == results[0]["expected"]
    assert not any(result["fsdp"] for result in results)


def _unsynced_default(rank: int, world_size: int) -> str:
    try:
        result = _tokens(rank, world_size, False, PROMPTS, False)
    except RuntimeError as err:
        return str(err)
    return "tokens equal" if result["got"] == result["expected"] else "tokens differ"


def test_a_rank_left_generating_alone_is_told_to_pass_synced_gpus():
    """Default path, synced_gpus=False: rank 0 stops after 3 tokens and leaves the model (here
    the process group); rank 1's next gather fails with a message naming the fix. Rank 0 itself
    cannot be told: it is no longer in the model."""
    pytest.importorskip("transformers")
    early, late = run_ranks(_unsynced_default, 2)
    assert early == "tokens equal"
    assert "synced_gpus=True" in late and "gathered_for_inference()" in late, late


# ---- the context's own behaviour (engine only, an MLP) ------------------------------------------
def _train_after_context(rank: int, world_size: int, fail_inside: bool) -> dict:
    """Training steps before and after a held block (which raises or not) match a reference
    that never ran it."""
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (reference, model)]
    step_side_by_side(reference, model, optimizers, mlp_batch(0), rank, world_size)
    x = mlp_batch(9)[0]
    with torch.no_grad():
        expected = reference(x)
    try:
        with sharded.gathered_for_inference(), torch.inference_mode():
            got = model(x)
            model(x)
            if fail_inside:
                raise KeyError("raised inside the block")
    except KeyError:
        pass
    held_diff = float((got - expected).abs().max())
    left = {"alive": sharded.stats.units.alive, "shadowed": _shadowed(model)}
    for step in range(1, 3):
        step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
    return {"held_diff": held_diff, **left, "param_diff": max_param_difference(sharded, reference)}


@pytest.mark.parametrize("fail_inside", [False, True], ids=["returns", "raises"])
def test_gathered_for_inference_leaves_sharded_units_and_exact_training(fail_inside: bool):
    for result in run_ranks(_train_after_context, 2, fail_inside):
        assert result["held_diff"] < 1e-6
        assert result["alive"] == 0, "a unit is still gathered after the context"
        assert not result["shadowed"], f"full tensors left on the modules: {result['shadowed']}"
        assert result["param_diff"] < 1e-5


def _gradients_inside(rank: int, world_size: int, what: str) -> str:
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model)
    x = mlp_batch(0)[0]
    loss = model(x).sum() if what == "backward" else None
    try:
        with sharded.gathered_for_inference():
            if what == "forward":
                model(x)
            elif what == "backward":
                loss.backward()
            elif what == "nested":
                with sharded.gathered_for_inference():
                    pass
            else:
                with torch.no_grad():
                    next(model.blocks[0].parameters()).add_(1.0)  # what an optimizer step does
                    model(x)
    except RuntimeError as err:
        message = str(err)
    else:
        message = "no error"
    assert sharded.stats.units.alive == 0 and not _shadowed(model)
    return message


@pytest.mark.parametrize("what", ["forward", "backward"])
def test_gradients_inside_gathered_for_inference_raise_on_every_rank(what: str):
    for message in run_ranks(_gradients_inside, 2, what):
        assert "inside gathered_for_inference()" in message and "torch.no_grad()" in message, message


def test_gathered_for_inference_inside_itself_is_refused_and_the_outer_one_gives_back_its_units():
    for message in run_ranks(_gradients_inside, 2, "nested"):
        assert "already active" in message and "do not nest" in message, message


def test_changed_shards_inside_gathered_for_inference_raise():
    for message in run_ranks(_gradients_inside, 2, "write"):
        assert "stale" in message, message


class HoldsInsideForward(MLP):
    """A model whose forward enters the context, as a training_step calling generate() would."""

    sharded: ShardedModel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.sharded.gathered_for_inference(), torch.no_grad():
            return super().forward(x)


def _held_inside_training_forward(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = HoldsInsideForward()
    model.sharded = ShardedModel(model)
    try:
        model(mlp_batch(0)[0])
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_gathered_for_inference_inside_a_forward_with_gradients_is_refused_on_every_rank():
    for message in run_ranks(_held_inside_training_forward, 2):
        assert "forward with gradients enabled" in message and "synced_gpus=True" in message, message


# ---- the thin strategy methods ------------------------------------------------------------------
class _HeldPredict(LitMLP):
    """predict_step runs inside `trainer.strategy.gathered_for_inference()`; each rank keeps its
    predictions (NaN where a forward inside gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.predicted: list[torch.Tensor] = []

    def predict_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        sharded = self.trainer.strategy.sharded_model()
        with self.trainer.strategy.gathered_for_inference():
            before = _gathers(sharded)
            out = self(batch[0])
            out = self(batch[0]) if _gathers(sharded) == before else torch.full_like(out, float("nan"))
        self.predicted.append(out)
        return out


def test_trainer_strategy_gathered_for_inference_predicts_without_gathers():
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = _HeldPredict()
    with torch.no_grad():
        expected = model(dataset().tensors[0])
    predicting = trainer(launched("zero3"), 2, callbacks=[HandsBack(predicted="lightning_module.predicted")])
    predicting.predict(model, DataLoader(dataset(), batch_size=6))
    for rank, predicted in enumerate(predicting.callback_metrics["predicted"]):
        # Each rank predicts its DistributedSampler share: samples rank, rank + 2, ...
        assert torch.allclose(torch.cat(predicted), expected[rank::2], atol=1e-6)


def _fabric_held(f: Any) -> list[dict]:
    from tests.support.fabric_helpers import every_rank

    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = f.setup_module(MLP())
    x = mlp_batch(0)[0]
    sharded = f.strategy.sharded_model(model)
    with f.strategy.gathered_for_inference(model), torch.no_grad():
        before = _gathers(sharded)
        got = model(x)
        inside = _gathers(sharded) - before
    return every_rank(
        {"diff": float((got - reference(x)).abs().max()), "inside": inside, "alive": sharded.stats.units.alive}
    )


def test_fabric_strategy_gathered_for_inference_runs_without_gathers():
    from tests.support.fabric_helpers import launch

    for result in launch(_fabric_held):
        assert result["diff"] < 1e-6 and result["inside"] == 0 and result["alive"] == 0
