"""Frozen layers (partial fine-tuning, LoRA): a unit with no trainable parameter is released
after forward like any other unit, measured on the storages autograd really keeps, re-gathered
for its backward when its input needs a gradient, and trains exactly like one process."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.shard import shard_slice
from tests.support.models import MLP, gpt_batch, mlp_batch
from tests.support.parity import Recipe, adamw, lm_loss, local_slice, run_parity
from tests.support.ranks import run_ranks

WIDTH, DEPTH = 512, 6  # 1 MiB of fp32 weight per layer
LAYER_BYTES = WIDTH * WIDTH * 4
FROZEN = {"middle": range(1, DEPTH - 1), "bottom": range(0, DEPTH - 2)}
# All-Gathers in the step: a unit runs backward (and is gathered again) when it is trainable or
# its input needs a gradient; frozen layers below every trainable one never do.
GATHERS = {"middle": 2 * DEPTH, "bottom": DEPTH + 2}


class LinearStack(nn.Module):
    def __init__(self, frozen: range) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))  # one unit each
        for i in frozen:
            self.layers[i].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _saved_storage_bytes(saved: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the tensors autograd saved (empty ones count 0)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values())


def _frozen_step(rank: int, world_size: int, frozen_name: str) -> dict:
    frozen = FROZEN[frozen_name]
    torch.manual_seed(0)
    reference = LinearStack(frozen)
    torch.manual_seed(0)
    model = LinearStack(frozen)
    sharded = ShardedModel(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * world_size, WIDTH, generator=g), torch.randn(4 * world_size, WIDTH, generator=g)
    saved: list[torch.Tensor] = []
    in_backward: list[int] = []  # measured when layer 0's output gets its gradient: layers 1.. are done

    def measure_in_backward(module: nn.Module, args: object, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: in_backward.append(_saved_storage_bytes(saved)))

    model.layers[0].register_forward_hook(measure_in_backward)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = (model(local_slice(x, rank, world_size)) - local_slice(y, rank, world_size)).pow(2).mean()
    after_forward = _saved_storage_bytes(saved)
    loss.backward()
    ((reference(x) - y).pow(2).mean()).backward()
    grad_diff = 0.0
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert (param.grad is None) == (ref.grad is None), f"gradient presence differs for {name}"
        if ref.grad is not None:
            sp = sharded.sharded_param(param)
            grad_diff = max(grad_diff, float((param.grad - shard_slice(ref.grad, sp.rank, world_size)).abs().max()))
    gathers = sharded.stats.shard_group.current["all_gather"].calls
    return {
        "saved_after_forward": after_forward,
        "saved_in_backward": in_backward,
        "grad_diff": grad_diff,
        "alive": sharded.stats.units.alive,
        "gathers": gathers,
    }


@pytest.mark.parametrize("frozen_name", list(FROZEN))
def test_frozen_units_hold_no_full_weights_between_forward_and_backward(frozen_name):
    """After forward, the storages reachable from autograd's saved tensors are the activations
    only (a few KiB), not the frozen layers' whole weights (4 x 1 MiB); in backward, a frozen
    layer's weights are freed as soon as its backward is over; gradients stay exact."""
    for result in run_ranks(_frozen_step, 2, frozen_name):
        kept = result["saved_after_forward"]
        assert kept < LAYER_BYTES // 4, f"autograd keeps {kept / 2**20:.2f} MiB of storage after forward"
        kept = max(result["saved_in_backward"], default=0)
        assert kept < LAYER_BYTES // 4, f"units done with backward still hold {kept / 2**20:.2f} MiB"
        assert result["gathers"] == GATHERS[frozen_name], f"{result['gathers']} All-Gathers in the step"
        assert result["grad_diff"] < 1e-5, f"shard gradients differ from the reference by {result['grad_diff']:.3g}"
        assert result["alive"] == 0, "a unit still holds whole parameters after backward"


def tiny_lora_gpt2() -> nn.Module:
    """A GPT-2-shaped HF model (2 layers, width 16) with LoRA adapters on the attention input
    projection: every base weight frozen, the adapters trainable inside the block units."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.GPT2Config(
        vocab_size=37, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, lora)


def hf_lm_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
    return lm_loss(output.logits, targets)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_lora_on_hf_gpt2_matches_single_process():
    """peft's LoRA on transformers' GPT-2: frozen root (embeddings, tied head), blocks mixing
    frozen base weights and trainable adapters; only the adapters get gradients and move."""
    pytest.importorskip("peft")
    results = run_ranks(run_parity, 2, Recipe(model=tiny_lora_gpt2, batch=gpt_batch, loss=hf_lm_loss, optimizer=adamw))
    for worst in results:
        assert max(worst["param"], worst["grad"], worst["loss"]) < 1e-5, f"LoRA run differs: {worst}"
        assert worst["moved"] > 1e-3, "the adapters did not train: parity would hold trivially"


def _greedy_generate(rank: int, world_size: int) -> tuple[list, list]:
    torch.manual_seed(0)
    reference = tiny_lora_gpt2()
    torch.manual_seed(0)
    model = tiny_lora_gpt2()
    ShardedModel(model)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        tokens = [m.generate(input_ids=prompt, **options) for m in (model, reference)]
    return tokens[0].tolist(), tokens[1].tolist()


@pytest.mark.slow
def test_generate_on_a_sharded_lora_model_gives_the_reference_tokens():
    """HF `generate` calls the model repeatedly outside any training step."""
    pytest.importorskip("peft")
    for got, expected in run_ranks(_greedy_generate, 2):
        assert got == expected


def mlp_frozen_checkpointed(mode: str) -> MLP:
    model = MLP(checkpointing=mode)
    model.blocks[1].requires_grad_(False)
    return model


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_frozen_block_under_activation_checkpointing_matches_single_process(mode):
    """The frozen block's forward runs again inside backward, where it is gathered once more."""
    recipe = Recipe(model=partial(mlp_frozen_checkpointed, mode), batch=mlp_batch, optimizer=adamw)
    for worst in run_ranks(run_parity, 2, recipe):
        assert max(worst["param"], worst["grad"], worst["loss"]) < 1e-5, f"differs from the reference: {worst}"


class InPlaceBlock(nn.Module):
    """A block that modifies its input in place, as some models' blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(13, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return self.fc(x) + x


class MLPWithInPlaceFrozenBlocks(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(InPlaceBlock() for _ in range(3))
        self.blocks[1].requires_grad_(False)


def test_frozen_block_that_modifies_its_input_in_place_matches_single_process():
    recipe = Recipe(model=MLPWithInPlaceFrozenBlocks, batch=mlp_batch, optimizer=adamw)
    for worst in run_ranks(run_parity, 2, recipe):
        assert max(worst["param"], worst["grad"], worst["loss"]) < 1e-5, f"differs from the reference: {worst}"
