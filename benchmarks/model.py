"""The GPT every backend trains (`examples/train_gpt.py`'s, imported: the example's model, not a
copy) and its batches: Python's help topics (`pydoc_data.topics`), one character per token, cut
into windows chosen by the seed, the same for every backend."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(_EXAMPLES) not in sys.path:
    sys.path.insert(0, str(_EXAMPLES))

from train_gpt import GPT, CharTokenizer, GPTConfig, load_text  # noqa: E402

# Parameter counts are for the character vocabulary of the help topics (~100 tokens).
SIZES: dict[str, dict[str, int]] = {
    "smoke": dict(n_layer=2, n_head=2, n_embd=32, block_size=32),  # ~0.03M: `--smoke` only
    "1m": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),  # ~0.8M (the example's "small")
    "5m": dict(n_layer=4, n_head=5, n_embd=320, block_size=128),  # ~5.0M
    "20m": dict(n_layer=6, n_head=8, n_embd=512, block_size=128),  # ~19M
    "85m": dict(n_layer=12, n_head=12, n_embd=768, block_size=256),  # ~85M: GPT-2 small's blocks, GPUs
    # GPT-2 small's shape: its 50,257-token vocabulary (embedding and tied LM head; the data use only the
    # first ~100 ids) and 1,024 positions, Ψ ≈ 124M. Trained on windows of WINDOW["124m"] tokens.
    "124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}
# Presets whose vocabulary is not the data's: the embedding is this many rows.
VOCAB: dict[str, int] = {"124m": 50257}
# Presets trained on windows shorter than their context (the 124M model's steps on 2 CPU cores).
WINDOW: dict[str, int] = {"124m": 128}


def make_config(size: str, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=max(vocab_size, VOCAB.get(size, 0)), dropout=0.0, **SIZES[size])


def window_length(size: str) -> int:
    """Tokens per training sequence: the context length unless WINDOW says otherwise."""
    return WINDOW.get(size, SIZES[size]["block_size"])


def build_model(config: GPTConfig, *, seed: int, device: torch.device) -> GPT:
    """The same initial weights on every rank and for every backend."""
    torch.manual_seed(seed)
    return GPT(config).to(device)


def count_parameters(model: nn.Module) -> int:
    """Ψ: elements of all parameters, the tied embedding/LM head counted once."""
    return sum(p.numel() for p in dict.fromkeys(model.parameters()))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))  # (B*T, V) vs (B*T,)


def make_batches(
    *, block_size: int, batch_size: int, world_size: int, steps: int, seed: int
) -> tuple[torch.Tensor, int]:
    """(steps, world_size, batch_size, block_size + 1) token windows and the vocabulary size.
    Step s, rank r trains on windows[s, r]: the global batch of step s is windows[s]."""
    text = load_text()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    generator = torch.Generator().manual_seed(seed)
    count = steps * world_size * batch_size
    starts = torch.randint(len(data) - block_size - 1, (count,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = data[starts[:, None] + offsets[None, :]]  # (count, T + 1)
    return windows.view(steps, world_size, batch_size, block_size + 1), len(tokenizer.chars)
