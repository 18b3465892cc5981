"""A module left sharded (its engine's hooks removed without making it whole, as the Lightning
strategies do after an exception) is made whole by the next engine built for it, before sharding
it again (engine/left_sharded.py, Note: a module left sharded); left sharded on some ranks only,
every rank raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, left_sharded
from tests.models import MLP, mlp_batch
from tests.parity import local_slice
from tests.ranks import RankFailure, run_ranks


def _left_sharded_then_sharded_again(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MLP()
    first = ShardedModel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = mlp_batch(0)
    F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    optimizer.step()
    trained = first.full_state_dict(to_rank=None)
    first.remove_hooks()  # what a failed run's teardown does: the shards stay in the module
    again = ShardedModel(model)
    assert {sp.name: sp.numel for sp in again.sharded_params} == {k: v.numel() for k, v in trained.items()}
    again.restore_module()
    return {"trained": trained, "restored": {k: v.clone() for k, v in model.state_dict().items()}}


def test_a_module_left_sharded_is_made_whole_before_it_is_sharded_again() -> None:
    for result in run_ranks(_left_sharded_then_sharded_again, 2):
        assert result["restored"].keys() == result["trained"].keys()
        for key, value in result["trained"].items():
            assert torch.equal(result["restored"][key], value), key


def _left_sharded_on_rank_0_only(rank: int, world_size: int) -> None:
    model = MLP()
    ShardedModel(model).remove_hooks()
    if rank == 1:
        left_sharded.unregister(model)  # as if rank 1 had never sharded it
    ShardedModel(model)


def test_a_module_left_sharded_on_some_ranks_only_is_refused_on_every_rank() -> None:
    with pytest.raises(RankFailure) as raised:
        run_ranks(_left_sharded_on_rank_0_only, 2)
    message = str(raised.value)
    for rank in (0, 1):
        assert f"--- rank {rank} ---\nRuntimeError: The module's parameters are still the shards" in message
    assert "on ranks [0] only" in message
