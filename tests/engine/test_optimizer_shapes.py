"""Parameters are 1-D shards (docs/design.md, "One-dimensional shards"): an optimizer whose update
depends on a parameter's shape or on all of it is refused at setup, naming the optimizer and
why; an empty param group, what a `p.dim() >= 2` filter leaves, is warned about; element-wise
optimizers pass silently."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero3.engine import check_optimizer_fits_shards
from tests.support import models
from tests.support.fabric_helpers import fabric
from tests.support.ranks import run_ranks


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


class Lamb(torch.optim.SGD):
    """Stands in for a LAMB from another library: matched by class name."""


class MyAdafactor(torch.optim.Adafactor):
    """A subclass of a refused optimizer is refused too."""


class MyMuon(torch.optim.Muon):
    """torch.optim.Muon steps on whole matrices (test_whole_matrices.py); a subclass, which may
    step differently, declares nothing and is refused."""


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda ps: torch.optim.Adafactor(ps), "row and column statistics"),
        (lambda ps: MyAdafactor(ps), "row and column statistics"),
        (lambda ps: MyMuon([p for p in ps if p.dim() == 2]), "orthogonalises"),
        (lambda ps: torch.optim.LBFGS(ps), "dot products over all parameters"),
        (lambda ps: Lamb(ps, lr=0.1), "norm of the whole parameter"),
    ],
)
def test_an_optimizer_that_needs_shapes_is_refused_naming_it_and_why(make, reason):
    optimizer = make(list(_linear().parameters()))
    with pytest.raises(ValueError, match=rf"Owner cannot train with {type(optimizer).__name__}: it .*{reason}.*1-D"):
        check_optimizer_fits_shards(optimizer, "Owner")


def test_the_refusal_names_the_parameter_and_the_optimizers_that_are_stepped_on_whole_matrices():
    model = _linear()
    names = {id(p): name for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"each parameter \(such as 'weight'\).*torch\.optim\.Muon.*whole_matrix\.py"):
        check_optimizer_fits_shards(torch.optim.Adafactor(model.parameters()), "Owner", names=names)


def test_torch_muon_passes_it_declares_whole_matrices():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_optimizer_fits_shards(torch.optim.Muon([_linear().weight]), "Owner")


@pytest.mark.parametrize("kind", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop])
def test_element_wise_optimizers_pass_without_a_warning(kind):
    optimizer = kind(_linear().parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_optimizer_fits_shards(optimizer, "Owner")


def test_a_param_group_left_empty_by_a_dim_filter_is_warned_about():
    shards = [p.detach().reshape(-1) for p in _linear().parameters()]  # what the optimizer sees
    groups = [
        {"params": [p for p in shards if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in shards if p.dim() < 2], "weight_decay": 0.0},
    ]
    with pytest.warns(UserWarning, match=r"param group\(s\) \[0\] of AdamW hold no parameter.*`p.dim\(\) >= 2`"):
        check_optimizer_fits_shards(torch.optim.AdamW(groups), "Owner")


def _fabric_setup_with_adafactor(rank: int, world_size: int) -> dict[str, Any]:
    f = fabric(rank, world_size)
    model = models.MLP()
    optimizer = torch.optim.Adafactor(model.parameters())
    try:
        f.setup(model, optimizer)
    except ValueError as err:
        return {"error": str(err), "dims": sorted({p.dim() for p in model.parameters()})}
    return {"error": None}


def test_fabric_refuses_a_shape_aware_optimizer_before_sharding_the_model():
    (result,) = run_ranks(_fabric_setup_with_adafactor, 1)
    assert result["error"] is not None and "ZeRO3FabricStrategy cannot train with Adafactor" in result["error"]
    assert result["dims"] == [1, 2], "the model was sharded before the refusal"


def _fit_with_adafactor(rank: int, world_size: int) -> str | None:
    from lightning_zero3 import ZeRO3Strategy
    from tests.support.lit import LitMLP, become_lightning_rank, loader, trainer

    class LitAdafactor(LitMLP):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adafactor(self.parameters())

    become_lightning_rank(rank, world_size)
    try:
        trainer(ZeRO3Strategy(), world_size, max_steps=1).fit(LitAdafactor(), loader(world_size))
    except ValueError as err:
        return str(err)
    return None


def test_the_trainer_strategy_refuses_a_shape_aware_optimizer_at_setup():
    (error,) = run_ranks(_fit_with_adafactor, 1)
    assert error is not None and "ZeRO3Strategy cannot train with Adafactor" in error
