"""A second backward through a retained graph (`loss.backward(retain_graph=True)`, then
`loss.backward()` again): after the first backward every unit call is DONE, and the second
one's pre-backward hooks gather the units again (calls.py, Note: call states: DONE -> BACKWARD).
The shard gradients must add up to what one process accumulates over both backwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.shard import shard_slice
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice, max_param_difference
from tests.support.ranks import run_ranks


def _two_backwards(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model)
    x, y = mlp_batch(0)
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    loss.backward(retain_graph=True)
    gathers_first = sharded.stats.shard_group.current["all_gather"].calls
    loss.backward()
    gathers_second = sharded.stats.shard_group.current["all_gather"].calls - gathers_first
    ref_grads = dict(reference.named_parameters())
    grad_diff = 0.0
    for param in model.parameters():
        sp = sharded.sharded_param(param)
        assert sp is not None and param.grad is not None
        expected = shard_slice(ref_grads[sp.name].grad, sp.rank, sp.world_size)
        grad_diff = max(grad_diff, float((param.grad - expected).abs().max()))
    for optimizer in (torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)):
        optimizer.step()
    return {
        "grad_diff": grad_diff,
        "param_diff": max_param_difference(sharded, reference),
        "gathers_second": gathers_second,
        "alive": sharded.stats.units.alive,
    }


def test_a_second_backward_through_a_retained_graph_adds_the_gradients_of_one_process():
    for result in run_ranks(_two_backwards, 2):
        assert result["grad_diff"] < 1e-6
        assert result["param_diff"] < 1e-6
        # The three blocks gather again for the second backward (the root unit too unless it
        # stayed whole); nothing is left gathered after it.
        assert result["gathers_second"] >= 3, result["gathers_second"]
        assert result["alive"] == 0
