"""Removing the engine's hooks (`restore_module`, `leave_sharded`) after a backward that raised:
the units that backward re-gathered must not stay on the modules in place of the parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero3.engine import ShardedModel
from tests.support.models import MLP, mlp_batch


def _raise(grad: torch.Tensor) -> None:
    raise RuntimeError("raised inside backward")


def _raise_in_backward(module: nn.Module, args: object, out: torch.Tensor) -> None:
    out.register_hook(_raise)


def _model_after_a_backward_that_raised() -> tuple[MLP, ShardedModel, dict[str, torch.Tensor]]:
    """One process. Block 0's output gradient raises, after the root and the blocks above it
    were gathered again for backward."""
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model, prefetch=0)
    whole = sharded.full_state_dict(to_rank=None)
    model.blocks[0].register_forward_hook(_raise_in_backward)
    with pytest.raises(RuntimeError, match="raised inside backward"):
        model(mlp_batch(0)[0]).sum().backward()
    return model, sharded, whole


def _shadowed(model: nn.Module) -> list[str]:
    return [f"{name}.{attr}" for name, m in model.named_modules() for attr in m._parameters if attr in m.__dict__]


def test_restore_module_after_a_backward_that_raised_registers_whole_parameters_visibly() -> None:
    model, sharded, whole = _model_after_a_backward_that_raised()
    sharded.restore_module()
    assert _shadowed(model) == []
    for name, value in model.state_dict().items():
        module, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        assert getattr(module, attr) is module._parameters[attr]
        assert torch.equal(value, whole[name]), name


def test_leave_sharded_after_a_backward_that_raised_leaves_the_shards_visible() -> None:
    model, sharded, _ = _model_after_a_backward_that_raised()
    sharded.leave_sharded()
    assert _shadowed(model) == []
    assert model.inp.weight.dim() == 1  # the shard, as registered
