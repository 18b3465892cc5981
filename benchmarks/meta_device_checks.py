"""The behaviours docs/large-models.md quotes for models built on the meta device, each printed by
the run that shows it: 2-rank `Trainer.fit` runs (`init_module(empty_init=True)`, `configure_model`
under "bf16-true", pretrained weights memory-mapped in `on_fit_start`) and one-process sharding of
small modules built under `torch.device("meta")` (what `param_init_fn` and `reset_parameters()`
produce, and the errors setup raises).

    PYTHONPATH=. python benchmarks/meta_device_checks.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero3 import ZeRO3Strategy
from lightning_zero3.engine import ShardedModel
from tests.lit import become_lightning_rank, trainer
from tests.ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_gpt import GPT, SIZES, CharTokenizer, GPTConfig, load_text  # noqa: E402


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)), batch_size=2)


class _MLP(pl.LightningModule):
    def __init__(self, *, lr: float = 0.01, in_configure_model: bool = False) -> None:
        super().__init__()
        self.lr, self.net = lr, None
        if not in_configure_model:
            self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.built: tuple[str, torch.dtype] | None = None
        self.shards: tuple[set[torch.dtype], str] | None = None

    def on_train_start(self) -> None:  # sharded by now
        self.shards = ({p.dtype for p in self.parameters()}, self.trainer.strategy.stats["param_dtype"])

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
            self.built = (self.net[0].weight.device.type, self.net[0].weight.dtype)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x.to(self.net[0].weight.dtype)), y.to(self.net[0].weight.dtype))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _init_module_fit(rank: int, world_size: int) -> str:
    become_lightning_rank(rank, world_size)
    torch.manual_seed(0)  # rank 0's draw is the one broadcast
    t = trainer(ZeRO3Strategy(), world_size, max_steps=2)
    with t.init_module(empty_init=True):
        model = _MLP()
    before = model.net[0].weight.device.type
    t.fit(model, _loader())
    weight = model.net[0].weight
    return f"before fit {before}; after fit {weight.device.type} {tuple(weight.shape)} std {weight.std():.3f}"


def _bf16_true_fit(rank: int, world_size: int) -> str:
    become_lightning_rank(rank, world_size)
    model = _MLP(in_configure_model=True)
    t = trainer(ZeRO3Strategy(), world_size, max_steps=1, precision="bf16-true")
    t.fit(model, _loader())
    return f"built {model.built}; shards {model.shards}"


def _mmap_load_fit(rank: int, world_size: int, path: str) -> str:
    become_lightning_rank(rank, world_size)

    class Loaded(_MLP):
        def on_fit_start(self) -> None:
            state_dict = torch.load(path, mmap=True, weights_only=True)
            self.trainer.strategy.load_model_state_dict({"state_dict": {f"net.{k}": v for k, v in state_dict.items()}})

    model = Loaded(lr=0.0, in_configure_model=True)
    trainer(ZeRO3Strategy(), world_size, max_steps=1).fit(model, _loader())
    expected = torch.load(path, weights_only=True)
    difference = max((model.net.state_dict()[k] - v).abs().max().item() for k, v in expected.items())
    return f"built on {model.built[0] if model.built else None}; max |weights - file| = {difference}"


def _shard(model: nn.Module, **options: Any) -> str:
    try:
        ShardedModel(model, device="cpu", **options)
    except ValueError as error:
        return f"ValueError: {error}"
    return "sharded"


def _one_process(rank: int, world_size: int) -> list[str]:
    lines = []
    torch.manual_seed(0)  # the figures below are draws: fixed for the docs to quote
    text = load_text()
    config = GPTConfig(vocab_size=len(CharTokenizer(text).chars), **SIZES["tiny"])

    def gpt_init(module: nn.Module) -> None:  # docs/large-models.md's example
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        else:
            module.reset_parameters()

    with torch.device("meta"):
        gpt = GPT(config)
    sharded = ShardedModel(gpt, device="cpu", param_init_fn=gpt_init)
    with sharded.gathered_parameters():
        lines.append(
            f"gpt_init on the tiny GPT: wte std {gpt.wte.weight.std():.4f}, h.0.mlp.c_fc.weight std "
            f"{gpt.h[0].mlp.c_fc.weight.std():.4f}, ln_f.weight all ones {bool((gpt.ln_f.weight == 1).all())}, "
            f"lm_head.weight is wte.weight {gpt.lm_head.weight is gpt.wte.weight}"
        )

    class InitInInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(512, 512)
            nn.init.normal_(self.lin.weight, std=0.02)

    with torch.device("meta"):
        model = InitInInit()
    sharded = ShardedModel(model, device="cpu")
    with sharded.gathered_parameters():
        lines.append(f"Linear(512, 512) given normal_(std=0.02) in __init__: std {model.lin.weight.std():.4f}")

    class Rotary(nn.Linear):  # has reset_parameters(), which does not recompute the buffer
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.register_buffer("inv_freq", 1 / 10000 ** (torch.arange(0, 8, 2) / 8))

    class WithBuffer(nn.Module):  # no reset_parameters()
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("freqs", 1 / 10000 ** (torch.arange(0, 8, 2) / 8))

    with torch.device("meta"):
        rotary = Rotary()
    _shard(rotary)
    lines.append(f"inv_freq after setup: {rotary.inv_freq.tolist()} (computed in __init__: [1.0, 0.1, 0.01, 0.001])")
    with torch.device("meta"):
        with_buffer = WithBuffer()
    lines.append(_shard(with_buffer))
    with torch.device("meta"):
        with_buffer = WithBuffer()
    _shard(with_buffer, param_init_fn=lambda m: m.freqs.copy_(torch.arange(4.0)) if hasattr(m, "freqs") else None)
    lines.append(f"with param_init_fn filling it: freqs {with_buffer.freqs.tolist()}")

    class TiedWithBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8)
            self.head.weight = self.wte.weight

    with torch.device("meta"):
        tied = TiedWithBias()
    lines.append(_shard(tied))
    with torch.device("meta"):
        attention = nn.Sequential(nn.MultiheadAttention(8, 2))
    lines.append(_shard(attention))
    return lines


def main() -> None:
    print("one process, built under torch.device('meta'):")
    for line in run_ranks(_one_process, 1, timeout_s=300)[0]:
        print(" ", line)
    for name, fn, args in [
        ("init_module(empty_init=True), 2 ranks", _init_module_fit, ()),
        ('configure_model under precision="bf16-true", 2 ranks', _bf16_true_fit, ()),
    ]:
        print(f"{name}:")
        for rank, line in enumerate(run_ranks(fn, 2, *args, timeout_s=300)):
            print(f"  rank {rank}: {line}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pretrained.pt")
        torch.manual_seed(3)
        torch.save(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)).state_dict(), path)
        print("configure_model on meta, pretrained file mmap-loaded in on_fit_start, lr=0, 2 ranks:")
        for rank, line in enumerate(run_ranks(_mmap_load_fit, 2, path, timeout_s=300)):
            print(f"  rank {rank}: {line}")


if __name__ == "__main__":
    main()
