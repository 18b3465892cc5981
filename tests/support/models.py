"""Small models used by the tests: each exercises one thing the engine must get right."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    """A pre-LN residual MLP block; odd sizes so 2 and 3 ranks need padding."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim + 1)
        self.fc2 = nn.Linear(3 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    """Input projection, a stack of blocks, output head. Units: one per block + root."""

    def __init__(self, dim: int = 13, depth: int = 3, out: int = 5, checkpointing: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(7, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, out)
        self.checkpointing = checkpointing  # None, "reentrant" or "non_reentrant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.checkpointing is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.checkpointing == "reentrant")
        return self.head(h)


class ReusedBlockModel(nn.Module):
    """The same block applied twice in one forward."""

    def __init__(self, dim: int = 11) -> None:
        super().__init__()
        self.inp = nn.Linear(7, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.blocks[0](h)
        h = self.blocks[1](h)
        h = self.blocks[0](h)  # used again
        return self.head(h)


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embedding, causal blocks, LM head tied to the token embedding."""

    def __init__(self, vocab: int = 37, dim: int = 16, heads: int = 2, depth: int = 2, context: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, dim)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def mlp_batch(seed: int, batch: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 7, generator=g), torch.randn(batch, 5, generator=g)


def gpt_batch(seed: int, batch: int = 6, context: int = 8, vocab: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, context + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


class RoutedMLP(MLP):
    """An MLP whose forward runs only the blocks listed in `route`, in that order: a stand-in for
    data-dependent control flow that a test can make differ between ranks."""

    def __init__(self, dim: int = 13, depth: int = 3) -> None:
        super().__init__(dim=dim, depth=depth)
        self.route = list(range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for index in self.route:
            h = self.blocks[index](h)
        return self.head(h)


def mlp_frozen_block() -> MLP:
    """An MLP whose middle block is frozen (its unit has no trainable parameter)."""
    model = MLP()
    model.blocks[1].requires_grad_(False)
    return model


def mlp_frozen_input() -> MLP:
    """An MLP whose input layer is frozen (the root unit mixes frozen and trainable parameters)."""
    model = MLP()
    model.inp.requires_grad_(False)
    return model


def mlp_biases_only() -> MLP:
    """An MLP that trains only its biases and norm weights (BitFit-style fine-tuning)."""
    model = MLP()
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith("bias") or ".norm." in name)
    return model
