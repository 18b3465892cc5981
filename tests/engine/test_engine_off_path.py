"""Uses off the plain training path: inference passes interleaved with training, inner modules
called directly, a forward that raises, a persistent parameter nobody uses. Each ends exactly
like one process on the global batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.shard import shard_slice
from tests.support.models import MLP, TinyGPT, gpt_batch, mlp_batch
from tests.support.parity import (
    Recipe,
    adamw,
    lm_loss,
    local_slice,
    max_param_difference,
    run_parity,
    step_side_by_side,
)
from tests.support.ranks import run_ranks

TOL = 1e-5


def _shadowed(model: nn.Module) -> list[str]:
    return [f"{name}.{attr}" for name, m in model.named_modules() for attr in m._parameters if attr in m.__dict__]


# ---- inference mode ---------------------------------------------------------------------------
def _train_with_inference_passes(rank: int, world_size: int) -> float:
    """inference_mode before the first step (the pool's buffers are first allocated there),
    then no_grad and inference_mode passes between steps; the reference trains without them."""
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (reference, model)]
    x = mlp_batch(9)[0]
    with torch.inference_mode():
        model(x)
    for step in range(3):
        step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
        with torch.no_grad() if step % 2 else torch.inference_mode():
            model(x)
        with torch.inference_mode():
            model(x)
    return max_param_difference(sharded, reference)


def test_inference_mode_and_no_grad_passes_in_any_order_leave_training_exact():
    for diff in run_ranks(_train_with_inference_passes, 2):
        assert diff < TOL, f"parameters differ from the reference by {diff:.3g}"


# ---- inner modules called directly --------------------------------------------------------------
class Wrapper(nn.Module):
    """Like a LightningModule holding `self.net`: the wrapper is the root unit's module, and
    the root parameters (embeddings, final norm, tied head) belong to modules inside `net`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyGPT()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)


def _lm_step(module: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(module(idx), targets)
    loss.backward()
    return loss


def _direct_inner_calls(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    reference = Wrapper()
    torch.manual_seed(0)
    model = Wrapper()
    sharded = ShardedModel(model)
    # SGD: attention's key bias has a gradient that is rounding noise, which Adam would amplify.
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    worst = {"no_grad": 0.0, "grad": 0.0, "param": 0.0, "leftover": 0.0}
    idx, targets = gpt_batch(0)
    with torch.no_grad():  # outside any forward of the root module
        worst["no_grad"] = float((model.net(idx) - reference.net(idx)).abs().max())
        worst["no_grad"] = max(worst["no_grad"], float((model.net.wte(idx) - reference.net.wte(idx)).abs().max()))
    _lm_step(reference.net, idx, targets)  # a training step through the inner module, with backward
    _lm_step(model.net, local_slice(idx, rank, world_size), local_slice(targets, rank, world_size))
    for param, ref in zip(model.parameters(), reference.parameters()):
        sp = sharded.sharded_param(param)
        worst["grad"] = max(worst["grad"], float((param.grad - shard_slice(ref.grad, sp.rank, world_size)).abs().max()))
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    worst["leftover"] = float(len(_shadowed(model)) + sharded.stats.units.alive)
    for step in range(1, 3):  # then ordinary steps through the root module
        for module, (x, y) in ((reference, gpt_batch(step)), (model, gpt_batch(step))):
            if module is model:
                x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            _lm_step(module, x, y)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    worst["param"] = max_param_difference(sharded, reference)
    return worst


def test_inner_modules_called_directly_see_whole_parameters_and_train_exactly():
    """`model.net(x)` and `model.net.wte(idx)` outside the root's forward, under no_grad and
    under grad with a backward (gradients exact), then ordinary training steps."""
    for worst in run_ranks(_direct_inner_calls, 2):
        assert worst["no_grad"] < TOL, f"direct no_grad call differs by {worst['no_grad']:.3g}"
        assert worst["grad"] < TOL, f"gradients of a direct call differ by {worst['grad']:.3g}"
        assert worst["leftover"] == 0, "whole parameters left on modules after the direct calls"
        assert worst["param"] < TOL, f"training afterwards differs by {worst['param']:.3g}"


# ---- exceptions ---------------------------------------------------------------------------------
class SimulatedOOM(RuntimeError):
    pass


def _raise_when_armed(module: nn.Module, args: object) -> None:
    if getattr(module, "armed", False):
        module.armed = False
        raise SimulatedOOM("out of memory (simulated)")


def _steps_after_a_caught_exception(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    model.blocks[1].fc2.register_forward_pre_hook(_raise_when_armed)  # inside the second block's unit
    sharded = ShardedModel(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    step_side_by_side(reference, model, optimizers, mlp_batch(0), rank, world_size)
    model.blocks[1].fc2.armed = True
    try:
        model(mlp_batch(1)[0])
    except SimulatedOOM:
        pass
    leftover = float(len(_shadowed(model)) + sharded.stats.units.alive)
    for step in range(1, 4):
        step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
    return {"leftover": leftover, "param": max_param_difference(sharded, reference)}


def test_steps_after_an_exception_inside_a_unit_match_single_process():
    """A block raising mid-forward (a caught out-of-memory) leaves no unit whole, and the three
    steps after it equal the reference's."""
    for result in run_ranks(_steps_after_a_caught_exception, 2):
        assert result["leftover"] == 0, "whole parameters left on modules after the exception"
        assert result["param"] < TOL, f"steps after the exception differ by {result['param']:.3g}"


def _raise_oom(grad: torch.Tensor) -> None:
    raise SimulatedOOM("out of memory (simulated)")


def _steps_after_a_caught_backward_exception(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    # Persistent biases and norms: their gradients are averaged in the callback ending backward.
    sharded = ShardedModel(model, persistence_threshold=64)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    step_side_by_side(reference, model, optimizers, mlp_batch(0), rank, world_size)
    hidden = model.blocks[0](model.inp(mlp_batch(1)[0]))
    hidden.register_hook(_raise_oom)  # backward raises after blocks 2 and 1 were reduced
    try:
        model.head(model.blocks[2](model.blocks[1](hidden))).sum().backward()
    except SimulatedOOM:
        pass
    for optimizer in optimizers:
        optimizer.zero_grad()
    for step in range(1, 4):
        step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
    return {"param": max_param_difference(sharded, reference), "alive": sharded.stats.units.alive}


def test_steps_after_an_exception_inside_backward_match_single_process():
    """A backward that raises halfway: once the gradients are zeroed, the next steps equal the
    reference's and no unit stays whole."""
    for result in run_ranks(_steps_after_a_caught_backward_exception, 2):
        assert result["param"] < TOL, f"steps after the exception differ by {result['param']:.3g}"
        assert result["alive"] == 0, "a unit still holds whole parameters"


def _steps_without_the_graph_task_id(rank: int, world_size: int) -> dict[str, float]:
    """Training where torch lacks the private `torch._C._current_graph_task_id` (hooks.py, Note:
    exceptions): the engine then trusts its own flag for whether a backward is running. With
    activation checkpointing, whose forwards rerun inside backward, where the answer matters
    (reentrant: torch's non-reentrant checkpoint needs that function itself)."""
    from lightning_zero3.engine.calls import autograd_running

    saved = torch._C._current_graph_task_id
    del torch._C._current_graph_task_id
    try:
        assert autograd_running(), "the fallback must assume a backward may be running"
        torch.manual_seed(0)
        reference = MLP(checkpointing="reentrant")
        torch.manual_seed(0)
        model = MLP(checkpointing="reentrant")
        sharded = ShardedModel(model, persistence_threshold=64)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
        for step in range(3):
            step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
    finally:
        torch._C._current_graph_task_id = saved
    return {"param": max_param_difference(sharded, reference), "alive": sharded.stats.units.alive}


def test_without_torchs_graph_task_id_training_still_matches_single_process():
    for result in run_ranks(_steps_without_the_graph_task_id, 2):
        assert result["param"] < TOL, f"training differs by {result['param']:.3g}"
        assert result["alive"] == 0, "a unit still holds whole parameters"


# ---- persistent parameters no rank used -----------------------------------------------------
class MLPWithUnusedLayer(MLP):
    """An MLP with a small layer its forward never calls (e.g. a head for another task)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(3, 3)


def test_persistent_parameter_nobody_used_keeps_no_gradient():
    """grad stays None (as in one process), so AdamW's weight decay does not move it."""
    recipe = Recipe(
        model=MLPWithUnusedLayer, batch=mlp_batch, optimizer=adamw, sharded_kwargs={"persistence_threshold": 64}
    )
    for worst in run_ranks(run_parity, 2, recipe):
        assert max(worst["param"], worst["grad"]) < TOL, f"differs from the reference: {worst}"


def _persistent_used_on_one_rank(rank: int, world_size: int) -> list | None:
    torch.manual_seed(0)
    model = MLPWithUnusedLayer()
    ShardedModel(model, persistence_threshold=64)
    x = torch.ones(2, 3)
    loss = model(mlp_batch(0)[0]).sum() + (model.unused(x).sum() if rank == 1 else 0.0)
    loss.backward()
    grad = model.unused.weight.grad
    return None if grad is None else grad.tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_persistent_parameter_used_on_one_rank_gets_the_same_averaged_gradient_everywhere(world_size):
    results = run_ranks(_persistent_used_on_one_rank, world_size)
    expected = (torch.full((3, 3), 2.0) / world_size).tolist()  # d(sum(W @ 1 + b)) / dW = 2 per row
    assert results == [expected] * world_size, results
