"""`reshard_after_forward` (engine/reshard.py): False keeps every unit whole from its forward to
its backward, an int G keeps a 1/G slice and gathers it inside groups of G ranks. Each equals one
process (parity), holds what it says (the storages autograd saved, not the engine's counters),
gathers where it says (broadcasts counted per process group under the engine), and leaves
nothing gathered after passes without a backward."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, ShardingConfig
from tests.models import MLP, Block, ReusedBlockModel, mlp_batch
from tests.parity import Recipe, adamw, local_slice, max_param_difference
from tests.ranks import RankFailure, run_ranks
from tests.test_engine_kept import SavedPerBlock
from tests.test_engine_parity import parity

TOL = 1e-5
DIM = 64
# A block's two weight matrices: the full block autograd saves them in holds at least these.
WEIGHT_BYTES = sum(p.numel() * 4 for p in Block(DIM).parameters() if p.dim() == 2)


def _frozen_checkpointed() -> MLP:
    """Non-reentrant checkpointing around every block, the middle one frozen."""
    model = MLP(checkpointing="non_reentrant")
    model.blocks[1].requires_grad_(False)
    return model


def _recipe(model, reshard, **options) -> Recipe:
    options = {"reshard_after_forward": reshard, **options}
    batch = partial(mlp_batch, batch=16)  # splits evenly over 2, 4 and 8 ranks
    return Recipe(model=model, batch=batch, optimizer=adamw, clip_norm=0.05, sharded_kwargs=options)


@pytest.mark.parametrize(
    ("model", "reshard", "world_size", "options"),
    [
        (_frozen_checkpointed, False, 2, {}),
        (ReusedBlockModel, False, 2, {}),
        (partial(MLP, checkpointing="reentrant"), False, 4, {"shard_size": 2}),
        (_frozen_checkpointed, 2, 4, {}),
        (ReusedBlockModel, 2, 4, {"prefetch": 2}),
        (MLP, 2, 8, {"shard_size": 4}),
    ],
    ids=["false-frozen-checkpointed-2", "false-reused-2", "false-reentrant-shard_size-4",
         "g2-frozen-checkpointed-4", "g2-reused-4", "g2-shard_size4-8"],
)  # fmt: skip
def test_reshard_after_forward_matches_single_process(model, reshard, world_size, options):
    """Clipping by global norm in every recipe; frozen units, a unit called twice in one
    forward, recomputation in backward (both kinds), shard groups."""
    parity(_recipe(model, reshard, **options), world_size)


def _bf16_alike(rank: int, world_size: int) -> list[float]:
    """bf16 gathers: the same training with each setting gives bit-identical parameters (the
    kept tensors and the slices hold the gathered bf16 values themselves)."""
    results = {}
    for reshard in (True, False, 2):
        torch.manual_seed(0)
        model = MLP()
        sharded = ShardedModel(model, param_dtype="bf16", reshard_after_forward=reshard)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(3):
            x, y = mlp_batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(local_slice(x, rank, world_size))
            F.mse_loss(out.float(), local_slice(y, rank, world_size)).backward()
            optimizer.step()
            optimizer.zero_grad()
        results[reshard] = sharded.full_state_dict(to_rank=None)
    moved = max(float((v - results[True][k]).abs().max()) for k, v in results[False].items())
    sliced = max(float((v - results[True][k]).abs().max()) for k, v in results[2].items())
    return [moved, sliced]


def test_bf16_gathers_train_alike_under_every_setting():
    for differences in run_ranks(_bf16_alike, 4):
        assert differences == [0.0, 0.0], differences


def _saved_after_forward(rank: int, world_size: int, reshard: bool | int) -> dict:
    """Bytes of full weights autograd saved inside each block, after forward and after backward."""
    torch.manual_seed(0)
    model = MLP(dim=DIM)
    sharded = ShardedModel(model, reshard_after_forward=reshard)
    x, y = mlp_batch(0)
    for _ in range(2):  # the second step runs with the recorded order
        saved = SavedPerBlock(model)
        loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        after_forward = [saved.weight_bytes(i) for i in range(len(model.blocks))]
        loss.backward()
        after_backward = [saved.weight_bytes(i) for i in range(len(model.blocks))]
    slices_left = [u.slice_comm is not None and u._slice is not None for u in sharded.units]
    return {"forward": after_forward, "backward": after_backward, "slices_left": slices_left}


@pytest.mark.parametrize(("reshard", "world_size"), [(True, 2), (False, 2), (2, 4)])
def test_what_each_setting_holds_between_forward_and_backward(reshard, world_size):
    """False: every block's full weights stay alive until its backward; True and G: only the
    last block's (kept because backward begins with it). Afterwards nothing, no slice left."""
    for result in run_ranks(_saved_after_forward, world_size, reshard):
        *released, last = result["forward"]
        assert last >= WEIGHT_BYTES, result
        if reshard is False:
            assert all(held >= WEIGHT_BYTES for held in released), result
        else:
            assert released == [0] * len(released), result
        assert result["backward"] == [0] * len(result["backward"]), result
        assert not any(result["slices_left"]), result


def _broadcasts_by_group(rank: int, world_size: int) -> dict:
    """The All-Gathers of a step with G=2 of 4 ranks, counted at torch.distributed (gloo's
    All-Gather is one broadcast per rank, engine/gloo.py): bytes per group size, by phase."""
    torch.manual_seed(0)
    model = MLP()
    ShardedModel(model, reshard_after_forward=2)
    counted: dict[str, dict[int, int]] = {"forward": {}, "backward": {}}
    phase = ["forward"]
    real = dist.broadcast

    def counting(tensor, *args, group=None, **kwargs):
        size = dist.get_world_size(group)
        counted[phase[0]][size] = counted[phase[0]].get(size, 0) + tensor.numel() * tensor.element_size()
        return real(tensor, *args, group=group, **kwargs)

    dist.broadcast = counting
    try:
        for step in range(2):
            phase[0] = "forward"
            x, y = mlp_batch(step)
            loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            phase[0] = "backward"
            loss.backward()
            if step == 0:
                counted = {"forward": {}, "backward": {}}  # the second step: an order is recorded
    finally:
        dist.broadcast = real
    return counted


def test_an_int_setting_gathers_in_backward_only_inside_its_group():
    for counted in run_ranks(_broadcasts_by_group, 4):
        assert set(counted["forward"]) == {4}, counted  # forward: the shard group of 4
        assert set(counted["backward"]) == {2}, counted  # backward: inside the pair
        # The pair gathers the units released after forward (MLP: 2 of its 3 blocks), each
        # a whole unit as large as its forward gather.
        assert 0.4 * counted["forward"][4] < counted["backward"][2] < 0.9 * counted["forward"][4], counted


def _passes_without_backward(rank: int, world_size: int, reshard: bool | int) -> dict:
    """Evaluation before training, a grad-enabled forward never backpropagated, a forward that
    raises, gathered_for_inference, retain_graph: nothing is left gathered between passes and
    training stays exact."""
    torch.manual_seed(0)
    reference = MLP(dim=DIM)
    torch.manual_seed(0)
    model = MLP(dim=DIM)
    sharded = ShardedModel(model, reshard_after_forward=reshard)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    alive = {}
    x, y = mlp_batch(0)
    mine = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    with torch.no_grad():
        model(mine[0])  # evaluation before training
    alive["after_eval"] = sharded.unit_stats.alive
    saved = SavedPerBlock(model)
    model(mine[0])  # grad enabled, never backpropagated
    held_then = sum(saved.weight_bytes(i) for i in range(len(model.blocks)))
    with torch.no_grad():
        model(mine[0])  # the next pass gives back what the first kept
    alive["after_next_pass"] = sharded.unit_stats.alive
    alive["left_by_first"] = sum(saved.weight_bytes(i) for i in range(len(model.blocks)))

    def fail(*_: object) -> None:
        raise KeyError("simulated")

    handle = model.head.register_forward_pre_hook(fail)
    with pytest.raises(KeyError):
        model(mine[0])
    handle.remove()
    alive["after_raise"] = sharded.unit_stats.alive
    with sharded.gathered_for_inference(), torch.no_grad():
        model(mine[0])
    alive["after_held"] = sharded.unit_stats.alive
    for step in range(3):  # retain_graph: two backwards through one forward, each one adds in
        x, y = mlp_batch(step)
        loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        loss.backward(retain_graph=True)
        loss.backward()
        (2 * F.mse_loss(reference(x), y)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        alive[f"after_step_{step}"] = sharded.unit_stats.alive
    sharded.end_step()
    return {"alive": alive, "held_then": held_then, "diff": max_param_difference(sharded, reference)}


@pytest.mark.parametrize(("reshard", "world_size"), [(False, 2), (2, 4)])
def test_passes_without_backward_leave_nothing_gathered(reshard, world_size):
    for result in run_ranks(_passes_without_backward, world_size, reshard):
        assert set(result["alive"].values()) == {0}, result
        if reshard is False:
            assert result["held_then"] >= 3 * WEIGHT_BYTES, result  # what the next pass had to free
        assert result["diff"] < TOL, result


@pytest.mark.parametrize(
    ("value", "expected"), [(1, "for 1 write False"), (0, "int G >= 2"), ("2", "int G >= 2"), (2.0, "int G >= 2")]
)
def test_bad_values_name_the_option_and_the_fix(value, expected):
    with pytest.raises(ValueError, match="reshard_after_forward") as raised:
        ShardingConfig(reshard_after_forward=value)
    assert expected in str(raised.value)


def _build(rank: int, world_size: int, reshard: int) -> bool:
    sharded = ShardedModel(MLP(), reshard_after_forward=reshard)
    return sharded.reshard


def test_an_int_must_divide_the_shard_group_and_the_whole_group_means_true():
    with pytest.raises(RankFailure) as raised:
        run_ranks(_build, 4, 3)
    text = raised.value.args[0]
    for rank in range(4):  # refused on every rank
        assert "must divide the shard group of 4 ranks" in text.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
    assert run_ranks(_build, 2, 2) == [True, True]
