"""Gradients of persistent parameters (kept whole on every rank): averaged over all ranks in one
All-Reduce, left in place as views of its buffer (persistent.py, Note: persistent gradients in
one buffer). Exact against one process through accumulation, frozen parameters and both kinds of
`zero_grad`, with and without shard groups."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from tests.support import models
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks

TOL = 1e-5
STEPS, MICRO = 3, 2


def _model() -> models.MLP:
    """Biases and norm weights (13 elements or fewer) persistent; one of them frozen."""
    torch.manual_seed(0)
    model = models.MLP()
    model.blocks[1].fc2.bias.requires_grad_(False)
    return model


def _train(rank: int, world_size: int, set_to_none: bool, shard_size: int | None, keep: bool = False) -> dict[str, Any]:
    """AdamW for STEPS steps of MICRO micro-batches; with `keep`, hold each step's persistent
    gradients past `zero_grad` (as a callback logging them might) and check they never change."""
    reference, model = _model(), _model()
    sharded = ShardedModel(model, persistence_threshold=13, shard_size=shard_size)
    assert len(sharded._persistent) >= 8
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    ref_params = dict(reference.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    worst = {"grad": 0.0, "param": 0.0}
    addresses = []  # per step: where each persistent gradient lives
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a gradient held past zero_grad, its values)
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = models.mlp_batch(step * MICRO + micro)
            (F.mse_loss(reference(x), y) / MICRO).backward()
            local = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            (local / MICRO).backward()
        for p in sharded._persistent:
            expected = ref_params[names[id(p)]].grad
            assert (p.grad is None) == (expected is None), names[id(p)]
            if p.grad is not None:
                worst["grad"] = max(worst["grad"], float((p.grad - expected).abs().max()))
        addresses.append([p.grad.data_ptr() if p.grad is not None else None for p in sharded._persistent])
        if keep:
            kept += [(p.grad, p.grad.clone()) for p in sharded._persistent if p.grad is not None]
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        full = sharded.full_state_dict(to_rank=None)
        for name, value in reference.state_dict().items():
            worst["param"] = max(worst["param"], float((full[name] - value).abs().max()))
    worst["kept"] = max((float((g - values).abs().max()) for g, values in kept), default=0.0)
    return {"worst": worst, "addresses": addresses, "copies": sharded._persistent_grads.copies}


@pytest.mark.slow
@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulated_persistent_gradients_match_one_process(set_to_none: bool) -> None:
    for result in run_ranks(_train, 3, set_to_none, None):
        assert result["worst"]["grad"] < TOL and result["worst"]["param"] < TOL, result["worst"]


def test_gradients_held_past_zero_grad_set_to_none_are_neither_reused_nor_changed() -> None:
    for result in run_ranks(_train, 2, True, None, True):
        worst = result["worst"]
        assert worst["grad"] < TOL and worst["param"] < TOL and worst["kept"] == 0.0, worst


@pytest.mark.slow
def test_persistent_gradients_stay_in_one_buffer_when_zeroed_in_place() -> None:
    """zero_grad(set_to_none=False): the first backward makes the buffer; every later one
    All-Reduces the gradients where autograd accumulated them (same addresses, no copy)."""
    for result in run_ranks(_train, 2, False, None):
        assert result["copies"] == 1
        first, *later = result["addresses"]
        assert all(step == first for step in later)


def test_persistent_gradients_set_to_none_are_copied_once_per_step() -> None:
    """set_to_none=True: the first micro-batch's gradients are autograd's own (one copy into a
    new buffer); the second accumulates into its views (no copy)."""
    for result in run_ranks(_train, 2, True, None):
        assert result["copies"] == STEPS


def _count_all_reduces(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    groups = []
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        groups.append(dist.get_world_size(kwargs.get("group")))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        result = _train(rank, world_size, False, 2)
        model = _model()
        sharded = ShardedModel(model, persistence_threshold=13, shard_size=2)
        groups.clear()
        sharded._persistent_grads.reduce()  # no gradient on this rank: still joins the collective
        result["groups"] = list(groups)
        result["grads"] = [p.grad for p in sharded._persistent]
    finally:
        dist.all_reduce = original
    return result


@pytest.mark.slow
def test_persistent_gradients_with_shard_groups_take_one_all_reduce_over_all_ranks() -> None:
    """4 ranks as 2 groups of 2: exact against one process, and one All-Reduce over the 4 ranks
    (was: one inside the group, then one across groups)."""
    for result in run_ranks(_count_all_reduces, 4):
        assert result["worst"]["grad"] < TOL and result["worst"]["param"] < TOL, result["worst"]
        assert result["groups"] == [4]
        assert result["grads"] == [None] * len(result["grads"])


class _TwoDtypes(torch.nn.Module):
    """A float32 layer and a small float64 scale, both kept whole."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.full((3,), 2.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale.float()


def _two_dtypes(rank: int, world_size: int) -> list[tuple[torch.dtype, list[float]]]:
    model = _TwoDtypes()
    ShardedModel(model, persistence_threshold=64)
    (model(torch.full((2, 3), float(rank + 1))).sum()).backward()
    return [(p.grad.dtype, p.grad.reshape(-1).tolist()) for p in (model.linear.bias, model.scale)]


def test_persistent_parameters_of_two_dtypes_get_gradients_of_their_own_dtype() -> None:
    """(Was: one buffer in the promoted dtype, and assigning its float64 slice to the float32
    bias raised.) One All-Reduce per dtype."""
    bias_grad = [4.0, 4.0, 4.0]  # 2 rows x scale 2, the same on every rank
    for got in run_ranks(_two_dtypes, 2):
        assert got[0] == (torch.float32, bias_grad)
        assert got[1][0] == torch.float64
