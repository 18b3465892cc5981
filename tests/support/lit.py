"""LightningModules and a single-process reference for the strategy tests.

Each rank process of `run_ranks` becomes a Lightning rank by setting the variables a
launcher like torchrun sets (LOCAL_RANK, WORLD_SIZE, ...): Lightning then uses the process
group that `run_ranks` already initialised instead of launching processes itself.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.support import models

SAMPLES = 48
GLOBAL_BATCH = 12


def become_lightning_rank(rank: int, world_size: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 7, generator=g), torch.randn(SAMPLES, 5, generator=g))


def loader(world_size: int) -> DataLoader:
    return DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size)


def param_groups(module: torch.nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """No weight decay for biases and norm weights, chosen by name (shards are all 1-D)."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        (no_decay if name.endswith("bias") or ".norm." in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class LitMLP(pl.LightningModule):
    def __init__(
        self, *, manual: bool = False, lr: float = 0.01, checkpointing: str | None = None, sgd: bool = False
    ) -> None:
        super().__init__()
        self.sgd = sgd
        self.net = models.MLP(checkpointing=checkpointing)
        self.automatic_optimization = not manual
        self.lr = lr
        self.step_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        self.step_losses.append(float(self.trainer.strategy.reduce(loss.detach())))
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=10 * self.lr)
        return torch.optim.AdamW(param_groups(self), lr=self.lr)


def trainer(strategy: Any, world_size: int, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        strategy=strategy,
        devices=world_size,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def reference_fit(
    model: LitMLP,
    *,
    epochs: int = 1,
    first_epoch: int = 0,
    max_steps: int | None = None,
    accumulate: int = 1,
    clip_norm: float | None = None,
    clip_value: float | None = None,
    autocast: torch.dtype | None = None,
    input_dtype: torch.dtype | None = None,
) -> list[float]:
    """Train `model` in one process on the global batches Lightning's shuffled
    DistributedSampler gives N ranks together; return the loss of each optimizer step.
    `autocast`: run forward and loss (only, as Lightning's mixed precision does) under it."""
    data = dataset()
    opt = model.configure_optimizers()
    losses, steps = [], 0
    for epoch in range(first_epoch, epochs):
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches = [order[i : i + GLOBAL_BATCH] for i in range(0, len(order), GLOBAL_BATCH)]
        for i, idx in enumerate(batches):
            x, y = data[idx]
            if input_dtype is not None:  # like Lightning's "-true" precisions
                x, y = x.to(input_dtype), y.to(input_dtype)
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = F.mse_loss(model(x), y)
            (loss / accumulate).backward()
            losses.append(float(loss.detach()))
            if (i + 1) % accumulate:
                continue
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
            opt.step()
            opt.zero_grad()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return losses
    return losses


def whole_state(model: pl.LightningModule) -> dict[str, torch.Tensor]:
    """`model`'s weights after `fit`, whole on every rank, read the user's way: under zero3 the
    module stays sharded, so `strategy.full_state_dict` (collective); else its state_dict."""
    strategy = model.trainer.strategy
    if hasattr(strategy, "full_state_dict"):
        return strategy.full_state_dict(rank0_only=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"state dict keys differ: {sorted(a.keys() ^ b.keys())}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
