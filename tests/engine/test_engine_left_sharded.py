"""A module left sharded (`ShardedModel.leave_sharded`: hooks removed, shards kept, as the
Lightning strategies do after an exception) refuses forward with an explanation, and the next
engine built for it makes it whole before sharding it again (engine/left_sharded.py, Note: a
module left sharded); left sharded on some ranks only, every rank raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.common.options import LightningOptions
from lightning_zero3.common.run import ShardedRun
from lightning_zero3.engine import ShardedModel
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice
from tests.support.ranks import RankFailure, run_ranks


def _left_sharded_then_sharded_again(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MLP()
    first = ShardedModel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = mlp_batch(0)
    F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    optimizer.step()
    trained = first.full_state_dict(to_rank=None)
    first.leave_sharded()  # what a failed run's teardown does: the shards stay in the module
    with pytest.raises(RuntimeError, match="MLP's parameters are still this rank's 1-D shards.*Shard it again with"):
        model(x)
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
    sharded = ShardedModel(model)
    if rank == 0:
        sharded.leave_sharded()
    else:
        sharded.remove_hooks()  # as if rank 1's module had been handed over otherwise
    ShardedModel(model)


def test_a_module_left_sharded_on_some_ranks_only_is_refused_on_every_rank() -> None:
    with pytest.raises(RankFailure) as raised:
        run_ranks(_left_sharded_on_rank_0_only, 2)
    message = str(raised.value)
    for rank in (0, 1):
        assert f"--- rank {rank} ---\nRuntimeError: MLP's parameters are still the shards of a failed run" in message
    assert "on ranks [0] only" in message


def test_a_run_left_sharded_by_a_strategy_names_lightnings_ways_on_forward() -> None:
    """A strategy's failed run (`ShardedRun.end(failed=True)`) leaves the module sharded with the
    strategies' words for what to do: the engine's own name none of Lightning."""
    model = MLP()
    ShardedRun(ShardedModel(model), lambda: LightningOptions()).end(failed=True)
    with pytest.raises(RuntimeError, match=r"still this rank's 1-D shards.*set it up again with `fabric.setup`"):
        model(mlp_batch(0)[0])
