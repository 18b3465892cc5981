"""Code that reads or edits parameters outside forward: `grad_norm` reports the whole gradients'
norms (DDP's numbers), not this rank's shards'. Lightning's weight-averaging and pruning callbacks
are refused (tests/lightning/test_lightning_{stochastic_weight_avg,weight_averaging,pruning}.py); averaging
on shards: tests/lightning/test_averaging.py. The Trainer's ranks are started by the strategy's launcher
(tests/support/adapted.py `launched`); Fabric's by the gloo harness (tests/support/ranks.py)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

from tests.support import models
from tests.support.adapted import HandsBack, launched
from tests.support.fabric_helpers import every_rank, launch
from tests.support.lit import LitMLP, loader, trainer
from tests.support.parity import local_slice


class _RecordsGradNorms(LitMLP):
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        import lightning_zero3

        self.norms = {k: float(v) for k, v in lightning_zero3.grad_norm(self, norm_type=2).items()}


def _norms_under(strategy: str) -> list[dict[str, float]]:
    """Each rank's norms of the first step, launched."""
    torch.manual_seed(0)
    fit = trainer(launched(strategy), 2, max_steps=1, callbacks=[HandsBack(norms="lightning_module.norms")])
    fit.fit(_RecordsGradNorms(), loader(2))
    return fit.callback_metrics["norms"]


@pytest.mark.slow
def test_grad_norm_in_a_lightning_module_equals_ddps() -> None:
    for ddp, zero3 in zip(_norms_under("ddp"), _norms_under("zero3"), strict=True):
        assert zero3.keys() == ddp.keys() and "grad_2.0_norm_total" in zero3 and len(zero3) > 10
        for key, value in ddp.items():
            assert abs(zero3[key] - value) < 1e-5 * max(1.0, value), key


def _fabric_norms(f: Any) -> list[dict[str, dict[str, float]]]:
    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    model = f.setup_module(models.MLP())
    x, y = models.mlp_batch(0)
    f.backward(F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)))
    out = {}
    for norm_type in (1, 2, "inf"):
        out[str(norm_type)] = {k: float(v) for k, v in f.strategy.grad_norm(model, norm_type).items()}
    out["shard"] = {k: float(v) for k, v in lightning_grad_norm(model, 2).items()}
    return every_rank(out)


def test_fabric_grad_norm_counts_sharded_and_whole_parameters_once() -> None:
    torch.manual_seed(0)
    reference = models.MLP()
    x, y = models.mlp_batch(0)
    F.mse_loss(reference(x), y).backward()
    # Parameters of at most 13 elements (norms, small biases) stay whole on every rank.
    for result in launch(_fabric_norms, persistence_threshold=13):
        for norm_type in (1, 2, "inf"):
            expected = lightning_grad_norm(reference, norm_type)
            got = result[str(norm_type)]
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                assert abs(got[key] - float(value)) < 1e-5 * max(1.0, float(value)), (norm_type, key)
        # What Lightning's own utility reports on a rank: the shards' norms, not the model's.
        total = float(lightning_grad_norm(reference, 2)["grad_2.0_norm_total"])
        assert abs(result["shard"]["grad_2.0_norm_total"] - total) > 1e-3


def test_grad_norm_outside_zero3_is_lightnings() -> None:
    import lightning_zero3

    model = pl.LightningModule()
    model.layer = torch.nn.Linear(3, 2)
    model.layer(torch.randn(4, 3)).sum().backward()
    ours, theirs = lightning_zero3.grad_norm(model, 2), lightning_grad_norm(model, 2)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
