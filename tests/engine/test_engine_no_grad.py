"""Forward without autograd (validation, predict): the output equals the reference's, and the
model is left exactly as sharded as before (every unit released, no full tensor on a module)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from tests.support.models import MLP, TinyGPT, gpt_batch, mlp_batch
from tests.support.parity import local_slice, max_param_difference, step_side_by_side
from tests.support.ranks import run_ranks

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
MODELS = {"mlp": (MLP, mlp_batch), "tiny_gpt": (TinyGPT, gpt_batch)}


def _registered(model: torch.nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {name: (id(p), tuple(p.shape)) for name, p in model.named_parameters()}


def _shadowed(model: torch.nn.Module) -> list[str]:
    """Parameters that an instance attribute (a gathered full tensor) still hides."""
    return [
        f"{module_name}.{attr}"
        for module_name, module in model.named_modules()
        for attr in module._parameters
        if attr in module.__dict__
    ]


def _forward_without_grad(rank: int, world_size: int, model_name: str, mode: str, train_first: bool) -> dict:
    factory, batch = MODELS[model_name]
    torch.manual_seed(0)
    reference = factory().eval()
    torch.manual_seed(0)
    model = factory().eval()
    sharded = ShardedModel(model)
    if train_first:  # a real step first, so the evaluation runs with a recorded schedule
        for m in (reference, model):
            m.train()
            optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
            x, y = batch(0)
            x, y = (x, y) if m is reference else (local_slice(x, rank, world_size), local_slice(y, rank, world_size))
            out = m(x)
            loss = F.mse_loss(out, y) if model_name == "mlp" else F.cross_entropy(out.flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
            m.eval()
    before = _registered(model)
    x, _ = batch(1)
    with MODES[mode]():
        out = model(x)
        expected = reference(x)
    return {
        "diff": float((out - expected).abs().max()),
        "changed": [name for name, value in _registered(model).items() if before[name] != value],
        "shadowed": _shadowed(model),
        "alive": sharded.stats.units.alive,
        "in_flight": [unit.name for unit in sharded._units if unit.gather_in_flight],
    }


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_forward_without_grad_matches_reference_and_leaves_parameters_sharded(model_name, mode):
    for result in run_ranks(_forward_without_grad, 3, model_name, mode, False):
        assert result["diff"] < 1e-5, f"output differs from the reference by {result['diff']:.3g}"
        assert result["changed"] == [], f"registered parameters replaced or reshaped: {result['changed']}"
        assert result["shadowed"] == [], f"full tensors left on modules: {result['shadowed']}"
        assert result["alive"] == 0 and result["in_flight"] == [], f"units still whole: {result}"


@pytest.mark.parametrize("mode", list(MODES))
def test_forward_without_grad_after_a_training_step_matches_reference(mode):
    """After a recorded step prefetching is active; evaluation prefetches along the record too and
    leaves nothing gathered or in flight."""
    for result in run_ranks(_forward_without_grad, 2, "mlp", mode, True):
        assert result["diff"] < 1e-5, f"output differs from the reference by {result['diff']:.3g}"
        assert result["changed"] == [] and result["shadowed"] == [], f"model not left sharded: {result}"
        assert result["alive"] == 0 and result["in_flight"] == [], f"units still whole: {result}"


def _train_around_evaluations(rank: int, world_size: int, mode: str) -> float:
    """Train 3 steps with an evaluation forward (on the whole batch) after each, next to a
    single-process reference; return the largest parameter difference at the end."""
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model, prefetch=1)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (reference, model)]
    for step in range(3):
        step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
        with MODES[mode]():
            model(mlp_batch(step)[0])
    return max_param_difference(sharded, reference)


@pytest.mark.parametrize("mode", list(MODES))
def test_training_after_evaluation_forwards_matches_reference(mode):
    """Nothing an evaluation forward gathers (inference tensors included) leaks into training."""
    for diff in run_ranks(_train_around_evaluations, 2, mode):
        assert diff < 1e-5, f"parameters differ from the reference by {diff:.3g}"


def _whole_under_inference_mode(sharded: ShardedModel, what: str) -> None:
    if what == "full_state_dict":
        sharded.full_state_dict()
    elif what == "gathered_parameters":
        with sharded.gathered_parameters():
            pass
    else:
        sharded.restore_module()


@pytest.mark.parametrize("what", ["full_state_dict", "gathered_parameters", "restore_module"])
def test_whole_parameters_taken_under_inference_mode_leave_training_possible(what: str) -> None:
    """One process. Lightning runs validation (and a checkpoint saved from its end) under
    inference_mode on NCCL: the pooled blocks and restored parameters made there must not be
    inference tensors (was: the next training step raised "Inplace update to inference tensor")."""
    model = MLP()
    sharded = ShardedModel(model)
    with torch.inference_mode():
        _whole_under_inference_mode(sharded, what)
    x, y = mlp_batch(0)
    F.mse_loss(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())
