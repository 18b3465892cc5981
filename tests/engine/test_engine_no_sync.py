"""Gradient accumulation without communication (engine/accumulate.py): with sync off, backward
sums each unit's full gradients locally; the first backward with sync on Reduce-Scatters once.
The shard gradients then equal one process's on the global batch, the Reduce-Scatter bytes per
optimizer step fall k-fold (accounting.py), the sums are freed at the sync, and what would give
wrong numbers (a step or zero_grad while sums are owed, a backward that raised) is refused."""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, accounting
from lightning_zero3.engine.accumulate import SyncState
from lightning_zero3.engine.shard import shard_slice
from tests.support.models import MLP, TinyGPT, gpt_batch, mlp_batch, mlp_frozen_block
from tests.support.parity import Recipe, adamw, lm_loss, local_slice, run_parity, sgd
from tests.support.ranks import run_ranks

TOL = 1e-5


class SkipsBlockOnEvenCalls(MLP):
    """Block 1 runs on odd calls only: a unit that some micro-batches do not use."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.inp(x)
        for index, block in enumerate(self.blocks):
            if index != 1 or self.calls % 2:
                h = block(h)
        return self.head(h)


def _recipes(rank: int, world_size: int) -> list[dict[str, float]]:
    recipes = [
        Recipe(model=mlp_frozen_block, batch=mlp_batch, optimizer=sgd, accumulate=2, sharded_kwargs={"shard_size": 1}),
        Recipe(model=TinyGPT, batch=gpt_batch, loss=lm_loss, optimizer=sgd, accumulate=3),  # tied weights
        Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, accumulate=3, sharded_kwargs={"persistence_threshold": 20}),
        Recipe(model=SkipsBlockOnEvenCalls, batch=mlp_batch, optimizer=adamw, accumulate=2),  # unused in the last
        Recipe(model=SkipsBlockOnEvenCalls, batch=mlp_batch, optimizer=adamw, accumulate=3,
               sharded_kwargs={"rank_checks": 2}),
    ]  # fmt: skip
    out = []
    for recipe in recipes:
        recipe.no_sync = True
        recipe.steps = 2
        out.append(run_parity(rank, world_size, recipe))
    return out


@pytest.mark.slow
def test_accumulation_without_sync_matches_single_process() -> None:
    """k = 2, 3 at 2 ranks: a frozen unit with shard groups (of 1: Reduce-Scatter, then All-Reduce
    across), tied weights, persistent parameters, a unit
    unused by the last micro-batch (reduced when the sync backward ends), rank checks every 2nd."""
    for rank_results in run_ranks(_recipes, 2):
        for i, worst in enumerate(rank_results):
            assert worst["param"] < TOL and worst["grad"] < TOL and worst["loss"] < TOL, (i, worst)
            assert worst["moved"] > 100 * TOL, (i, worst)


def _micro_batches(sharded: ShardedModel, model: torch.nn.Module, reference: torch.nn.Module, first: int,
                   k: int, rank: int, world_size: int, between=None, unsynced: bool = True) -> float:  # fmt: skip
    """k micro-batches (all but the last with sync off) on both models; the largest difference of
    the shard gradients from the reference's slices. `between(micro)` runs after each unsynced one."""
    for micro in range(k):
        x, y = mlp_batch(first + micro)
        (F.mse_loss(reference(x), y) / k).backward()
        with sharded.no_sync() if unsynced and micro < k - 1 else nullcontext():
            (F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)) / k).backward()
        if between is not None and micro < k - 1:
            between(micro)
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        sp = sharded.sharded_param(param)
        expected = shard_slice(ref[name].grad, rank, world_size) if sp is not None else ref[name].grad
        worst = max(worst, float((param.grad - expected).abs().max()))
    return worst


def _models(**options: object) -> tuple[ShardedModel, torch.nn.Module, torch.nn.Module, list]:
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model, **options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    return sharded, model, reference, optimizers


def _step(optimizers: list, set_to_none: bool = True) -> None:
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)


def _formula(sharded: ShardedModel, **counts: int) -> dict[str, int]:
    assert sharded.stats.last_step_record is not None
    orders = sharded.stats.last_step_record.orders
    return accounting.expected_step_bytes(sharded._units, sharded._persistent, orders=orders, **counts)


def _bytes_and_buffers(rank: int, world_size: int, k: int) -> dict:
    sharded, model, reference, optimizers = _models(persistence_threshold=20)  # biases, norms: All-Reduced
    out: dict = {"diff": 0.0, "alive": [], "held_bytes": []}
    held: list[weakref.ref[torch.Tensor]] = []

    def note(micro: int) -> None:
        totals = [summed.total for _, summed in sorted(sharded._gradient_sync._summed.items())]
        held.extend(weakref.ref(t) for t in totals)
        out["held_bytes"].append(sum(t.numel() * t.element_size() for t in totals))

    for step, unsynced in enumerate([False, False, True, True]):  # step 0 records the order
        held.clear()

        run = partial(_micro_batches, sharded, model, reference, step * k, k, rank, world_size)
        if unsynced:
            out["diff"] = max(out["diff"], run(between=note))
        else:  # every micro-batch reduced
            for micro in range(k):
                x, y = mlp_batch(step * k + micro)
                (F.mse_loss(reference(x), y) / k).backward()
                (F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)) / k).backward()
        out["alive"].append(sum(ref() is not None for ref in held))
        _step(optimizers)
        sharded.stats.end_step()
        out.setdefault("steps", []).append({
            kind: sharded.stats.shard_group.last_step[kind].payload_bytes
            for kind in ("all_gather", "reduce_scatter", "all_reduce")
        })  # fmt: skip
        if step == 1:  # the record's count of backwards and synced ones gives the formula its k
            out["synced_formula"] = sharded.stats.last_step_expected_bytes()
            assert out["synced_formula"] == _formula(sharded, micro_batches=k)
        if step == 3:
            out["unsynced_formula"] = sharded.stats.last_step_expected_bytes()
            assert out["unsynced_formula"] == _formula(sharded, micro_batches=k, synced=1)
    out["full_numel"] = sum(u.world_size * u.shard_numel for u in sharded._units)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("k", [3])
def test_reduce_scatter_bytes_fall_k_fold_and_the_sums_are_freed_at_the_sync(k: int) -> None:
    for result in run_ranks(_bytes_and_buffers, 2, k):
        assert result["diff"] < TOL, result
        synced, unsynced = result["steps"][1], result["steps"][3]
        assert synced == result["synced_formula"] and unsynced == result["unsynced_formula"], result
        assert unsynced["reduce_scatter"] * k == synced["reduce_scatter"], result  # k-fold fewer
        assert unsynced["all_reduce"] * k == synced["all_reduce"] > 0, result  # the persistent gradients' too
        assert unsynced["all_gather"] == synced["all_gather"], result
        # The sums: every unit's full gradient in fp32 while owed, none alive after the sync step.
        assert result["held_bytes"][-1] == 4 * result["full_numel"], result
        assert result["alive"] == [0, 0, 0, 0], result


def _errors(rank: int, world_size: int) -> dict:
    out: dict = {}
    sharded, model, reference, optimizers = _models()

    def expect(key: str, action) -> None:
        try:
            action()
        except RuntimeError as err:
            out[key] = str(err)

    def unsynced_backward(seed: int) -> None:
        x, y = mlp_batch(seed)
        with sharded.no_sync():
            F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()

    def backward(seed: int) -> None:
        x, y = mlp_batch(seed)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()

    # A step while owed.
    unsynced_backward(0)
    out["owed_state"] = sharded._gradient_sync.state.name
    expect("step", optimizers[1].step)
    # zero_grad while owed, both ways: the next backward refuses; discard and go on.
    for set_to_none in (True, False):
        sharded.discard_unsynced_gradients()
        optimizers[1].zero_grad()
        if not set_to_none:  # gradients from a synced backward, then zeroed in place
            backward(1)
        unsynced_backward(2)
        optimizers[1].zero_grad(set_to_none=set_to_none)
        expect(f"zero_grad_{set_to_none}", partial(backward, 3))
        out[f"state_{set_to_none}"] = sharded._gradient_sync.state.name
    # A backward that raises with sync off: the sums are incomplete until discarded.
    sharded.discard_unsynced_gradients()
    optimizers[1].zero_grad()

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("injected")

    x, y = mlp_batch(4)  # a hook on block 0's output raises once the units after it ran backward
    handle = model.blocks[0].register_forward_hook(lambda module, args, output: output.register_hook(boom) and None)
    try:
        with sharded.no_sync():
            F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    except ValueError:
        out["raised"] = True
    handle.remove()
    with torch.no_grad():  # a forward closes the backward that raised (hooks.py, Note: exceptions)
        model(local_slice(x, rank, world_size))
    out["incomplete_state"] = sharded._gradient_sync.state.name
    expect("after_raise_backward", partial(backward, 5))
    expect("after_raise_step", optimizers[1].step)
    # Discarded: a fresh accumulation, with evaluation passes between, equals one process again.
    sharded.discard_unsynced_gradients()
    for optimizer in optimizers:
        optimizer.zero_grad()

    def infer(micro: int) -> None:  # evaluation between micro-batches leaves the sums alone
        x, _ = mlp_batch(100 + micro)
        with torch.no_grad():
            model(local_slice(x, rank, world_size))
        with sharded.gathered_for_inference(), torch.no_grad():
            model(local_slice(x, rank, world_size))

    out["diff_after"] = _micro_batches(sharded, model, reference, 6, 3, rank, world_size, between=infer)
    out["final_state"] = sharded._gradient_sync.state.name
    return out


def test_step_zero_grad_and_a_raising_backward_while_unsynced_are_refused() -> None:
    for result in run_ranks(_errors, 2):
        assert result["owed_state"] == SyncState.OWED.name
        assert "optimizer.step() while" in result["step"] and "not been reduced" in result["step"], result
        for set_to_none in (True, False):
            assert "cleared or replaced" in result[f"zero_grad_{set_to_none}"], result
            assert result[f"state_{set_to_none}"] == SyncState.INCOMPLETE.name, result
        assert result["raised"] and result["incomplete_state"] == SyncState.INCOMPLETE.name, result
        assert "backward raised" in result["after_raise_backward"], result
        assert "incomplete" in result["after_raise_step"], result
        assert result["diff_after"] < TOL and result["final_state"] == SyncState.SYNCED.name, result


def _bf16_reduction(rank: int, world_size: int, k: int) -> dict:
    sharded, model, reference, _ = _models(reduce_dtype="bf16")
    error = _micro_batches(sharded, model, reference, 0, k, rank, world_size)
    largest = max(float(p.grad.abs().max()) for p in reference.parameters())
    return {"relative": error / largest}


def test_sums_reduced_in_bf16_carry_one_rounding_whatever_k() -> None:
    """The sums are fp32, rounded to the bf16 reduce dtype once, then summed over ranks in it
    (Note: unsynced accumulation): within two bf16 roundings (2^-7) of the largest gradient at k = 16."""
    for result in run_ranks(_bf16_reduction, 2, 16):
        assert result["relative"] < 2**-7, result
