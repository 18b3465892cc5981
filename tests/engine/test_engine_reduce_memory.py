"""Full gradients are not kept while their Reduce-Scatter is in flight (engine/reduce.py, Note:
gradient copy-in): with reductions left running, only their inputs stay, as in FSDP2. Measured
by the bytes of earlier units' full gradients still alive when each unit's reduction starts."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice, max_param_difference
from tests.support.ranks import run_ranks


def _full_grad_bytes_alive(rank: int, world_size: int, in_flight: int) -> dict:
    torch.manual_seed(0)
    reference = MLP(depth=4)
    torch.manual_seed(0)
    model = MLP(depth=4)
    sharded = ShardedModel(model, prefetch=1, reductions_in_flight=in_flight)
    reductions = sharded._gradient_sync.reductions
    start = type(reductions).start
    seen: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []

    def spy(self, unit, grads):  # noqa: ANN001, ANN202 - a spy on Reductions.start
        alive.append(sum(t.numel() * t.element_size() for t in (ref() for ref in seen) if t is not None))
        seen.extend(weakref.ref(g) for g in grads if g is not None)
        return start(self, unit, grads)

    reductions.start = spy.__get__(reductions)  # type: ignore[method-assign]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(2):
        seen.clear()
        alive.append(-1)  # a step begins
        x, y = mlp_batch(step)
        F.mse_loss(reference(x), y).backward()
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return {"alive": alive, "diff": max_param_difference(sharded, reference)}


@pytest.mark.parametrize("in_flight", [0, 2])
def test_no_full_gradient_outlives_its_units_backward(in_flight):
    for result in run_ranks(_full_grad_bytes_alive, 2, in_flight):
        assert result["diff"] < 1e-5, result
        assert len(result["alive"]) == 2 * (1 + 5), result  # 5 units reduced per step
        assert set(result["alive"]) == {-1, 0}, result
