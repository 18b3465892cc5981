"""`ShardedModel.gathered_parameters(module)`: the parameters under `module` are whole on every
rank inside the block; with `modifier_rank=r`, rank r's writes are kept on every rank after it,
and without it writes are discarded, so ranks can never drift apart."""

from __future__ import annotations

import pytest
import torch

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.checks import OrderMismatchError
from tests.support.models import MLP, TinyGPT
from tests.support.ranks import RankFailure, run_ranks

FILL = 0.5


def _inside_gathered(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = TinyGPT()
    torch.manual_seed(0)
    model = TinyGPT()
    sharded = ShardedModel(model)
    seen = {}
    with sharded.gathered_parameters(model.blocks[1]):
        for name, param in model.blocks[1].named_parameters():
            ref = reference.blocks[1].get_parameter(name)
            seen[name] = (tuple(param.shape) == tuple(ref.shape), float((param - ref).abs().max()))
        outside = tuple(model.blocks[0].mlp[0].weight.shape)
    with sharded.gathered_parameters(model.lm_head):  # tied to wte: gathered through either owner
        tied = (tuple(model.lm_head.weight.shape), float((model.lm_head.weight - reference.wte.weight).abs().max()))
    after = {name: tuple(p.shape) for name, p in model.named_parameters()}
    shard_shapes = {sp.name: (sp.shard_numel,) for sp in sharded.sharded_params}
    return {"seen": seen, "outside": outside, "tied": tied, "after": after, "shard_shapes": shard_shapes}


@pytest.fixture(scope="module")
def inside_gathered() -> list[dict]:
    """What each of 3 ranks saw inside and after `gathered_parameters` (one run, two tests)."""
    return run_ranks(_inside_gathered, 3)


def test_gathered_parameters_are_whole_and_equal_to_the_reference(inside_gathered: list[dict]) -> None:
    for result in inside_gathered:
        for name, (same_shape, diff) in result["seen"].items():
            assert same_shape, f"blocks.1.{name} is not whole inside gathered_parameters"
            assert diff == 0.0, f"blocks.1.{name} differs from the reference by {diff:.3g}"
        assert result["tied"] == ((37, 16), 0.0), f"tied lm_head.weight not whole: {result['tied']}"


def test_gathered_parameters_leaves_other_modules_and_the_model_afterwards_sharded(
    inside_gathered: list[dict],
) -> None:
    for result in inside_gathered:
        assert len(result["outside"]) == 1, "a module outside the gathered scope was gathered too"
        assert result["after"] == result["shard_shapes"], "parameters not back to their shards after the block"


def _write_on_rank0(rank: int, world_size: int, modifier_rank: int | None, persistence_threshold: int) -> dict:
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model, persistence_threshold=persistence_threshold)
    written = ["blocks.1.fc1.weight", "blocks.1.fc1.bias", "head.bias"]  # the biases are small
    with sharded.gathered_parameters(modifier_rank=modifier_rank):
        if rank == 0:
            with torch.no_grad():
                for name in written:
                    model.get_parameter(name).fill_(FILL)
    full = sharded.full_state_dict(to_rank=None)
    ref = reference.state_dict()
    return {
        "filled": {name: bool((full[name] == FILL).all()) for name in written},
        "untouched": max(float((full[k] - ref[k]).abs().max()) for k in ref if k not in written),
        "restored": {name: float((full[name] - ref[name]).abs().max()) for name in written},
        "persistent": len(sharded._persistent),
    }


@pytest.mark.parametrize("persistence_threshold", [0, 64], ids=["all_sharded", "small_params_whole"])
def test_writes_under_modifier_rank_are_kept_on_every_rank(persistence_threshold):
    for rank, result in enumerate(run_ranks(_write_on_rank0, 3, 0, persistence_threshold)):
        assert all(result["filled"].values()), f"rank {rank} did not keep rank 0's writes: {result['filled']}"
        assert result["untouched"] == 0.0, f"rank {rank}: parameters nobody wrote changed"
        assert (result["persistent"] > 0) == (persistence_threshold > 0)


@pytest.mark.parametrize("persistence_threshold", [0, 64], ids=["all_sharded", "small_params_whole"])
def test_writes_without_modifier_rank_are_discarded(persistence_threshold):
    for rank, result in enumerate(run_ranks(_write_on_rank0, 3, None, persistence_threshold)):
        assert max(result["restored"].values()) == 0.0, f"rank {rank} kept a write: {result['restored']}"
        assert result["untouched"] == 0.0, f"rank {rank}: parameters nobody wrote changed"
        assert (result["persistent"] > 0) == (persistence_threshold > 0)


@pytest.mark.parametrize("use", ["gathered_parameters", "full_state_dict"])
def test_whole_parameters_outside_forward_reuse_one_block_and_keep_nothing_after(use: str) -> None:
    """Inside, such a gather reuses one receive buffer and one block for every unit (each unit is
    copied out of it); after it the pool holds nothing it made (buffers.py, Note: what the pool
    keeps), so a callback each step or a full checkpoint each epoch leaves no memory taken."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    sharded = ShardedModel(model)  # one process: one unit per Linear, both of one size
    unit, pool = sharded._units[-1], sharded._pool
    receive = unit.world_size * unit.row_numel(unit.shard_dtype) * 4
    block = unit.block_numel * 4
    for _ in range(3):
        pool.reset_peak()
        if use == "gathered_parameters":
            with sharded.gathered_parameters():
                pass
        else:
            sharded.full_state_dict()
        assert pool.bytes() == {"pooled": 0, "taken": 0, "peak": receive + block}


def test_evaluation_forwards_return_their_blocks_to_the_pool() -> None:
    """A forward without autograd owes no backward: each unit's block goes back to the pool when
    the unit's forward ends, so evaluation steps reuse blocks instead of allocating new ones."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    sharded = ShardedModel(model, prefetch=0)  # one process: one unit per Linear, both of one size
    unit = sharded._units[-1]
    for _ in range(3):
        with torch.no_grad():
            model(torch.randn(4, 32))
    receive = unit.world_size * unit.row_numel(unit.shard_dtype) * 4
    assert sharded._pool.cached_bytes == receive + unit.block_numel * 4  # one of each, reused


@pytest.mark.parametrize("modifier_rank", [None, 0])
def test_a_tag_check_that_raises_on_entry_leaves_every_parameter_its_shard(modifier_rank: int | None) -> None:
    """One process; the check after the gathers raises (as a mismatch between ranks would):
    no parameter keeps the gathered whole data (was: all of them did, for good), and no
    modifier's broadcast runs (the other ranks may be gone)."""
    model = MLP()
    sharded = ShardedModel(model, persistence_threshold=16)
    before = {name: (p.shape, p.data_ptr()) for name, p in model.named_parameters()}

    def mismatch() -> None:
        raise OrderMismatchError("ranks gathered different units")

    def broadcast(*args: object, **kwargs: object) -> None:
        raise AssertionError("a collective after a failed entry")

    sharded._checks.closely = False  # the gathers defer their checks to that one
    sharded._checks.check = mismatch  # type: ignore[method-assign]
    sharded.world_comm.broadcast = broadcast  # type: ignore[method-assign]
    with pytest.raises(OrderMismatchError), sharded.gathered_parameters(modifier_rank=modifier_rank):
        pass
    assert {name: (p.shape, p.data_ptr()) for name, p in model.named_parameters()} == before


def test_a_broadcast_that_fails_on_exit_leaves_every_parameter_its_shard() -> None:
    """One process; the modifier's first broadcast on exit raises (as a rank gone would): every
    parameter has its shard back, not only those broadcast before the failure."""
    model = MLP()
    sharded = ShardedModel(model)
    before = {name: (p.shape, p.data_ptr()) for name, p in model.named_parameters()}

    def broadcast(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the broadcast failed")

    sharded.world_comm.broadcast = broadcast  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the broadcast failed"), sharded.gathered_parameters(modifier_rank=0):
        pass
    assert {name: (p.shape, p.data_ptr()) for name, p in model.named_parameters()} == before


def _entered_on_rank_0_only(rank: int, world_size: int) -> None:
    """`if rank == 0: with gathered_parameters(): ...`, the other rank going on to a barrier."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = TinyGPT()
    sharded = ShardedModel(model)
    if rank == 0:
        with sharded.gathered_parameters():
            model.state_dict()
    dist.barrier()


@pytest.mark.slow
def test_gathered_parameters_entered_on_rank_0_only_names_the_cause_and_the_fix_there() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_entered_on_rank_0_only, 2, timeout_s=10)
    entered = str(failure.value).split("--- rank 0 ---")[1].split("--- rank")[0]
    assert entered.startswith(
        "\nCollectiveError: gathered_parameters could not gather on rank 0: every rank must enter it"
    ), entered
    assert "Move it out of the `if`, on every rank" in entered
