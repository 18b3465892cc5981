"""The pass state (engine/calls.py, `PassState`) the driver is in, seen from inside the model: idle
between passes, forward while a unit's forward hook is open, backward while autograd runs
through the units, held inside `gathered_for_inference()`; and back to idle after a pre-forward
that raised."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.calls import PassState
from tests.support.models import MLP, mlp_batch


def test_the_pass_state_follows_forward_backward_and_held():
    model = MLP()
    sharded = ShardedModel(model, prefetch=1)
    seen = []
    model.blocks[0].register_forward_hook(lambda *_: seen.append(("block forward", sharded._hooks.state)))
    x, y = mlp_batch(0)
    assert sharded._hooks.state is PassState.IDLE

    def on_block_output(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.append(("block backward", sharded._hooks.state)))

    hook = model.blocks[0].register_forward_hook(on_block_output)
    out = model(x)
    seen.append(("after forward", sharded._hooks.state))
    out.register_hook(lambda g: seen.append(("loss grad", sharded._hooks.state)))
    hook.remove()
    F.mse_loss(out, y).backward()
    seen.append(("after backward", sharded._hooks.state))
    with torch.no_grad(), sharded.gathered_for_inference():
        model(x)
        seen.append(("inside gathered_for_inference", sharded._hooks.state))
    seen.append(("after gathered_for_inference", sharded._hooks.state))
    P = PassState
    assert seen == [
        ("block forward", P.FORWARD), ("after forward", P.IDLE), ("loss grad", P.BACKWARD),
        ("block backward", P.BACKWARD), ("after backward", P.IDLE), ("block forward", P.KEPT),
        ("inside gathered_for_inference", P.KEPT), ("after gathered_for_inference", P.IDLE),
    ]  # fmt: skip


def test_a_pre_forward_that_raises_leaves_the_driver_idle_and_the_next_pass_trains():
    model = MLP()
    sharded = ShardedModel(model, prefetch=1)
    root = sharded._units[0]
    gather = type(root).gather

    def failing_once(self, *args, **kwargs):  # noqa: ANN001, ANN202
        self.gather = gather.__get__(self)
        raise RuntimeError("gather failed")

    root.gather = failing_once.__get__(root)  # type: ignore[method-assign]
    x, y = mlp_batch(0)
    with pytest.raises(RuntimeError, match="gather failed"), torch.no_grad():
        model(x)
    assert (sharded._hooks.state, sharded._hooks.calls.open) == (PassState.IDLE, 0)
    F.mse_loss(model(x), y).backward()
    assert sharded._schedule.forward_order == [0, 1, 2, 3]
    assert all(p.grad is not None for p in model.parameters())
