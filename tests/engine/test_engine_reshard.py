"""`reshard_after_forward` (engine/reshard.py): False keeps every unit whole from its forward to
its backward, an int G keeps a 1/G slice and gathers it inside groups of G ranks. Each equals one
process (parity), holds what it says (the storages autograd saved, not the engine's counters),
gathers where it says (broadcasts counted per process group under the engine), and leaves
nothing gathered after passes without a backward."""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, ShardingConfig
from tests.engine.test_engine_kept import SavedPerBlock
from tests.engine.test_engine_parity import parity
from tests.support.models import MLP, Block, ReusedBlockModel, RoutedMLP, mlp_batch
from tests.support.parity import Recipe, adamw, local_slice, max_param_difference
from tests.support.ranks import RankFailure, run_ranks

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
@pytest.mark.slow
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


@pytest.mark.slow
def test_bf16_gathers_train_alike_under_every_setting():
    for differences in run_ranks(_bf16_alike, 4):
        assert differences == [0.0, 0.0], differences


def _held_and_gathered(rank: int, world_size: int, reshard: bool | int) -> dict:
    """Per block, the bytes of full weights autograd saved inside it after forward and after
    backward; the All-Gather bytes per process-group size in forward and in backward, counted at
    torch.distributed (gloo's All-Gather is one broadcast per rank, engine/transport.py)."""
    torch.manual_seed(0)
    model = MLP(dim=DIM)
    sharded = ShardedModel(model, reshard_after_forward=reshard)
    x, y = mlp_batch(0)
    real, phase = dist.broadcast, ["forward"]

    def counting(tensor, *args, group=None, **kwargs):
        size, counted = dist.get_world_size(group), gathered[phase[0]]
        counted[size] = counted.get(size, 0) + tensor.numel() * tensor.element_size()
        return real(tensor, *args, group=group, **kwargs)

    dist.broadcast = counting
    try:
        for _ in range(2):  # the second step runs with the recorded order
            gathered: dict[str, dict[int, int]] = {"forward": {}, "backward": {}}
            saved, phase[0] = SavedPerBlock(model), "forward"
            loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
            after_forward = [saved.weight_bytes(i) for i in range(len(model.blocks))]
            phase[0] = "backward"
            loss.backward()
            after_backward = [saved.weight_bytes(i) for i in range(len(model.blocks))]
    finally:
        dist.broadcast = real
    slices_left = [u._slice is not None for u in sharded._units]
    return {"forward": after_forward, "backward": after_backward, "slices_left": slices_left, "gathered": gathered}


@pytest.mark.parametrize(("reshard", "world_size"), [(False, 2), (2, 4)])
def test_what_each_setting_holds_and_where_it_gathers(reshard, world_size):
    """False: every block's full weights stay alive until its backward, which gathers nothing.
    G=2 of 4: only the last block's (kept: backward begins with it), and backward gathers only
    inside the pair of ranks, the released blocks (2 of the MLP's 3 blocks, each as large as its
    forward gather). Afterwards no full weights and no slice are left."""
    for result in run_ranks(_held_and_gathered, world_size, reshard):
        *released, last = result["forward"]
        assert last >= WEIGHT_BYTES, result
        if reshard is False:
            assert all(held >= WEIGHT_BYTES for held in released), result
        else:
            assert released == [0] * len(released), result
        assert result["backward"] == [0] * len(result["backward"]), result
        assert not any(result["slices_left"]), result
        forward, backward = result["gathered"]["forward"], result["gathered"]["backward"]
        assert set(forward) == {world_size}, result  # forward: over the shard group
        if reshard is False:
            assert backward == {}, result
        else:
            assert set(backward) == {2}, result
            assert 0.4 * forward[world_size] < backward[2] < 0.9 * forward[world_size], result


def _passes_without_backward(rank: int, world_size: int, reshard: bool | int) -> dict:
    """Evaluation before training, a grad-enabled forward never backpropagated, a forward that
    raises, a backward that does not reach every unit, gathered_for_inference, retain_graph:
    nothing is left gathered between passes and training stays exact."""
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
    alive["after_eval"] = sharded.stats.units.alive
    saved = SavedPerBlock(model)
    model(mine[0])  # grad enabled, never backpropagated
    held_then = sum(saved.weight_bytes(i) for i in range(len(model.blocks)))
    slices_then = sum(u._slice is not None for u in sharded._units)
    with torch.no_grad():
        model.inp(mine[0])  # the next pass (the root alone) gives back what the first kept
    alive["after_next_pass"] = sharded.stats.units.alive
    alive["slices_after_next_pass"] = sum(u._slice is not None for u in sharded._units)
    alive["left_by_first"] = sum(saved.weight_bytes(i) for i in range(len(model.blocks)))

    def fail(*_: object) -> None:
        raise KeyError("simulated")

    handle = model.head.register_forward_pre_hook(fail)
    with pytest.raises(KeyError):
        model(mine[0])
    handle.remove()
    alive["after_raise"] = sharded.stats.units.alive
    hidden: list[torch.Tensor] = []
    handle = model.blocks[0].register_forward_hook(lambda module, args, out: hidden.append(out))
    model(mine[0])
    handle.remove()
    hidden[0].square().sum().backward()  # never reaches the later blocks
    optimizers[1].zero_grad()
    alive["after_partial_backward"] = sharded.stats.units.alive
    alive["slices_after_partial_backward"] = sum(u._slice is not None for u in sharded._units)
    with sharded.gathered_for_inference(), torch.no_grad():
        model(mine[0])
    alive["after_held"] = sharded.stats.units.alive
    for step in range(3):  # retain_graph: two backwards through one forward, each one adds in
        x, y = mlp_batch(step)
        loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        loss.backward(retain_graph=True)
        loss.backward()
        (2 * F.mse_loss(reference(x), y)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        alive[f"after_step_{step}"] = sharded.stats.units.alive
    sharded.stats.end_step()
    alive["slices_at_end"] = sum(u._slice is not None for u in sharded._units)
    return {"alive": alive, "held_then": held_then, "slices_then": slices_then,
            "diff": max_param_difference(sharded, reference)}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("reshard", "world_size"), [(False, 2), (2, 4)])
def test_passes_without_backward_leave_nothing_gathered(reshard, world_size):
    for result in run_ranks(_passes_without_backward, world_size, reshard):
        assert set(result["alive"].values()) == {0}, result
        if reshard is False:
            assert result["held_then"] >= 3 * WEIGHT_BYTES, result  # what the next pass had to free
        else:
            assert result["slices_then"] == 2, result  # the blocks released after forward
        assert result["diff"] < TOL, result


@pytest.mark.parametrize(
    ("value", "expected"), [(1, "for 1 write False"), (0, "int G >= 2"), ("2", "int G >= 2"), (2.0, "int G >= 2")]
)
def test_bad_values_name_the_option_and_the_fix(value, expected):
    with pytest.raises(ValueError, match="reshard_after_forward") as raised:
        ShardingConfig(reshard_after_forward=value)
    assert expected in str(raised.value)


def _build(rank: int, world_size: int) -> tuple[str, bool | int]:
    try:
        ShardedModel(MLP(), reshard_after_forward=3)
        refused = ""
    except ValueError as err:
        refused = str(err)
    return refused, ShardedModel(MLP(), reshard_after_forward=2)._reshard


def test_an_int_must_divide_the_shard_group_and_the_whole_group_means_true():
    for refused, resolved in run_ranks(_build, 2):  # on every rank
        assert "reshard_after_forward=3 must divide the shard group of 2 ranks" in refused
        assert resolved is True


def _routed(rank: int, world_size: int, routes: list[list[list[int]]]) -> str:
    torch.manual_seed(0)
    model = RoutedMLP(depth=3)
    ShardedModel(model, reshard_after_forward=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, per_rank in enumerate(routes):
        model.route = per_rank[rank]
        x, y = mlp_batch(step, batch=16)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


def test_ranks_running_different_units_with_slices_raise_on_every_rank():
    """One rank of 4 runs its blocks in another order in the forward of step 2 (step 1 kept
    slices and gathered them in pairs): every rank raises OrderMismatchError naming the unit."""
    same = [[0, 1, 2]] * 4
    with pytest.raises(RankFailure) as failure:
        run_ranks(_routed, 4, [same, [*same[:3], [1, 0, 2]]], timeout_s=20)
    per_rank = re.split(r"--- rank \d+ ---\n", str(failure.value))[1:]
    assert len(per_rank) == 4 and all(err.startswith("OrderMismatchError") for err in per_rank), failure.value
