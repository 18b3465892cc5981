"""Checkpoints the checkpoint tests share: a TinyGPT (tied lm_head/wte) trained a few AdamW steps
on this process group, saved as a sharded checkpoint and loaded into a fresh one
(tests/conftest.py `gpt_saved_at_2` saves one for the session), and an MLP's saved by one
process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_zero3 import ShardedModel
from lightning_zero3 import checkpoint as ckpt
from lightning_zero3.engine.state import full_optimizer_state
from tests.support.models import MLP, TinyGPT, gpt_batch


def trained_gpt(seed: int = 0, *, steps: int = 2, **shard_options: Any) -> tuple[TinyGPT, ShardedModel, Any]:
    """TinyGPT (tied lm_head/wte) sharded over this process group, trained `steps` AdamW steps
    with two param groups; `seed` changes the initial weights."""
    torch.manual_seed(seed)
    model = TinyGPT()
    sharded = ShardedModel(model, **shard_options)
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.01)
    for step in range(steps):
        x, y = gpt_batch(step)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, sharded, optimizer


def whole_state(sharded: ShardedModel, optimizer: Any) -> tuple[dict, dict]:
    """The model's full state dict and the optimizer's full state dict, on every rank."""
    return sharded.full_state_dict(to_rank=None), full_optimizer_state(sharded, optimizer, to_rank=None)


def step_once(model: TinyGPT, optimizer: Any) -> None:
    x, y = gpt_batch(7)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def save_trained_gpt(
    rank: int, world_size: int, path: str, threshold: int = 0, shard_size: int | None = None, then_step: bool = False
) -> Any:
    """The saved state, whole; with `then_step` also the state after one more step."""
    model, sharded, optimizer = trained_gpt(persistence_threshold=threshold, shard_size=shard_size)
    optimizer_states = [ckpt.sharded_optimizer_state(sharded, optimizer)]
    checkpoint = {"epoch": 3, "state_dict": model.state_dict(), "optimizer_states": optimizer_states, "note": "kept"}
    ckpt.save_sharded(path, sharded, checkpoint)
    # Optimizer state of parameters kept whole comes live, as from torch's optimizer.state_dict().
    saved = copy.deepcopy(whole_state(sharded, optimizer))
    if not then_step:
        return saved
    step_once(model, optimizer)
    return saved, whole_state(sharded, optimizer)


def load_into_fresh_gpt(
    rank: int, world_size: int, path: str, threshold: int = 0, shard_size: int | None = None, then_step: bool = False
) -> tuple[dict, dict, dict]:
    """The loaded state, whole, and the file's extra entries; with `then_step` the state after
    one more step instead."""
    # Different weights and optimizer state than the saved ones: everything must come from the file.
    model, sharded, optimizer = trained_gpt(seed=1, steps=1, persistence_threshold=threshold, shard_size=shard_size)
    extra = ckpt.load_sharded(path, sharded, optimizers=[optimizer])
    if then_step:
        step_once(model, optimizer)
    return (*whole_state(sharded, optimizer), extra)


def save_mlp(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A sharded checkpoint of an MLP with AdamW state, saved by this one process; its weights."""
    torch.manual_seed(seed)
    model = MLP()
    sharded = ShardedModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    optimizer_states = [ckpt.sharded_optimizer_state(sharded, optimizer)]
    ckpt.save_sharded(
        path, sharded, {"epoch": 1, "state_dict": model.state_dict(), "optimizer_states": optimizer_states}
    )
    return sharded.full_state_dict(to_rank=None)
