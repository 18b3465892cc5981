"""`wrap_policy` decides the units (what is gathered together). It is checked when the
ShardedModel is built, with a message that says what was expected and what was given. These run
in one process (no process group): the plan is the same on every rank."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.plan import validate_wrap_policy
from tests.support.models import MLP, Block, GPTBlock, TinyGPT


def unit_names(model: nn.Module, policy=None) -> list[str]:
    return [unit.name for unit in ShardedModel(model, wrap_policy=policy)._units]


def unit_params(model: nn.Module, policy=None) -> dict[str, list[str]]:
    return {unit.name: [p.name for p in unit.params] for unit in ShardedModel(model, wrap_policy=policy)._units}


@pytest.mark.parametrize(
    "policy",
    [Block, "Block", 42, {Block, "Block"}, {int}, [MLP().blocks[0]], MLP().blocks[0]],
    ids=["class_not_in_a_set", "string", "int", "set_with_a_string", "set_with_a_non_module", "module_instances",
         "module_instance"],
)  # fmt: skip
def test_bad_wrap_policy_is_rejected_with_what_was_expected_and_given(policy):
    with pytest.raises(ValueError, match="wrap_policy must be None") as error:
        validate_wrap_policy(policy)
    assert repr(policy)[:40] in str(error.value), "the message does not show what was given"
    assert "set of nn.Module classes" in str(error.value) and "callable" in str(error.value)


def test_bad_wrap_policy_is_rejected_when_the_sharded_model_is_built():
    model = MLP()
    with pytest.raises(ValueError, match="wrap_policy must be None"):
        ShardedModel(model, wrap_policy=Block)
    assert all(p.dim() == 2 for name, p in model.named_parameters() if name.endswith("weight") and "norm" not in name)


def test_automatic_policy_makes_each_repeated_block_a_unit():
    assert unit_names(MLP(depth=3)) == ["<root>", "blocks.0", "blocks.1", "blocks.2"]


def test_set_of_classes_makes_every_instance_a_unit():
    assert unit_names(MLP(depth=2), {Block}) == ["<root>", "blocks.0", "blocks.1"]
    assert unit_names(MLP(depth=2), {nn.Linear}) == [
        "<root>", "inp", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "head",
    ]  # fmt: skip


def test_callable_policy_makes_the_modules_it_accepts_units():
    names = unit_names(MLP(depth=2), lambda module: isinstance(module, nn.LayerNorm))
    assert names == ["<root>", "blocks.0.norm", "blocks.1.norm"]


def test_nested_units_keep_their_own_parameters():
    params = unit_params(MLP(depth=1), {Block, nn.Linear})
    assert params["blocks.0"] == ["blocks.0.norm.weight", "blocks.0.norm.bias"]
    assert params["blocks.0.fc1"] == ["blocks.0.fc1.weight", "blocks.0.fc1.bias"]
    assert params["<root>"] == []


def test_tied_weight_belongs_to_the_common_ancestor_of_its_users():
    """wte.weight is also lm_head.weight: gathered once, in the unit that encloses both."""
    params = unit_params(TinyGPT(), {GPTBlock, nn.Embedding, nn.Linear})
    assert "wte.weight" in params["<root>"]
    assert params["wte"] == [] and params["lm_head"] == []
    assert [name for names in params.values() for name in names].count("wte.weight") == 1
