"""Fabric on `run_ranks` ranks, and the single-process reference Fabric runs are compared with.

Each rank sets the variables a launcher like torchrun sets (tests/lit.py): Fabric's launcher then
runs in place and reuses the process group `run_ranks` initialised."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import models
from tests.lit import become_lightning_rank
from tests.parity import local_slice, no_decay_for_biases_and_norms

LR = 0.01


def fabric(rank: int, world_size: int, strategy: Any = "zero3", **kwargs: Any) -> Any:
    """A launched Fabric for this rank."""
    import lightning as L

    import lightning_zero3  # noqa: F401 - registers "zero3"

    become_lightning_rank(rank, world_size)
    f = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy, **kwargs)
    f.launch()
    return f


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(no_decay_for_biases_and_norms(model), lr=LR)


def train_step(
    fabric: Any, model: nn.Module, optimizer: Any, step: int, rank: int, world_size: int, clip: float | None
) -> tuple[float, float | None]:
    """One step on this rank's slice of global batch `step`; (mean loss over ranks, grad norm)."""
    x, y = models.mlp_batch(step)
    loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    fabric.backward(loss)
    norm = fabric.clip_gradients(model, optimizer, max_norm=clip) if clip is not None else None
    optimizer.step()
    optimizer.zero_grad()
    return float(fabric.all_reduce(loss.detach())), None if norm is None else float(norm)


def reference(steps: int, clip: float | None = None, first: int = 0) -> tuple[nn.Module, list[tuple[float, Any]]]:
    """One process training `models.MLP()` (seed 0) on the whole global batches."""
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = adamw(model)
    out = []
    for step in range(first, first + steps):
        x, y = models.mlp_batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
        optimizer.step()
        optimizer.zero_grad()
        out.append((float(loss.detach()), None if norm is None else float(norm)))
    return model, out


def full_state(fabric: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    return fabric.strategy.sharded_model(model).full_state_dict(to_rank=None)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"state dict keys differ: {sorted(a.keys() ^ b.keys())}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
