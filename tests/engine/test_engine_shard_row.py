"""Shards in one buffer (engine/shard.py, Note: shards in one buffer): a unit's shards live back
to back in one buffer, yet stay separate Parameters, each with its own version counter, and a
shard given other memory (`.data = ...`) is still gathered exactly."""

from __future__ import annotations

import torch

from lightning_zero3.engine import ShardedModel
from tests.support.models import MLP, TinyGPT


def _sharded() -> tuple[torch.nn.Module, ShardedModel]:
    torch.manual_seed(0)
    model = MLP()
    return model, ShardedModel(model)


def test_each_units_shards_lie_back_to_back_in_one_buffer():
    _, sharded = _sharded()
    units = [u for u in sharded._units if len(u.params) > 1]
    assert units, "the test model needs a unit with several parameters"
    for unit in units:
        storage = unit.params[0].param.untyped_storage().data_ptr()
        for sp, offset in zip(unit.params, unit.offsets):
            assert sp.param.untyped_storage().data_ptr() == storage, f"{sp.name} is not in its unit's buffer"
            assert sp.param.storage_offset() == offset, f"{sp.name} is not at its offset in the buffer"


def test_writing_one_shard_leaves_the_other_shards_versions_alone():
    _, sharded = _sharded()
    unit = next(u for u in sharded._units if len(u.params) > 1)
    first, second = unit.params[0].param, unit.params[1].param
    before = second._version
    with torch.no_grad():
        first.add_(1.0)
    assert second._version == before, "shards of one row share a version counter"


def test_a_forward_changes_no_shard_version():
    torch.manual_seed(0)
    model = TinyGPT()
    sharded = ShardedModel(model)
    versions = [sp.param._version for sp in sharded.sharded_params]
    model(torch.randint(0, 37, (2, 8))).sum().backward()
    assert [sp.param._version for sp in sharded.sharded_params] == versions, "gathers wrote into the shards"


def test_a_shard_given_other_memory_is_gathered_from_that_memory():
    model, sharded = _sharded()
    unit = next(u for u in sharded._units if len(u.params) > 1)
    moved = unit.params[0]
    with torch.no_grad():
        moved.param.data = moved.param.data.clone() + 1.0  # leaves the row, whose copy is now stale
    expected = moved.param.detach()[: moved.numel].reshape(moved.whole_shape)  # one rank: the shard is whole
    fulls = unit.gather()
    assert torch.equal(fulls[0], expected), "the gather sent the row's stale copy of a moved shard"
    unit.release(fulls)
