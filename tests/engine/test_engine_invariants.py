"""The invariants of docs/design.md, measured on real ranks: shard sizes (1), communication per
step (3), the number of units whole at once (4), nothing kept between steps (5) and both ways
of communicating (6)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.transport import NativeCollectives
from tests.support.models import MLP, TinyGPT, gpt_batch, mlp_batch, mlp_frozen_block
from tests.support.parity import lm_loss, local_slice, max_param_difference, step_side_by_side
from tests.support.ranks import run_ranks

MODELS = {
    "mlp": (MLP, mlp_batch, torch.nn.functional.mse_loss),
    "tiny_gpt": (TinyGPT, gpt_batch, lm_loss),
    "deep_mlp": (partial(MLP, depth=5), mlp_batch, torch.nn.functional.mse_loss),
    "mlp_frozen_block": (mlp_frozen_block, mlp_batch, torch.nn.functional.mse_loss),
}


def _train(model_name: str, rank: int, world_size: int, *, steps: int, **sharded_kwargs):
    """A sharded model and an AdamW over its parameters, after `steps` training steps; the
    gradients and the comm stats' `last_step` are the last step's."""
    factory, batch, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = factory()
    sharded = ShardedModel(model, **sharded_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        sharded.stats.reset_peaks()
        optimizer.zero_grad()  # first, so the last step's gradients stay for inspection
        x, y = batch(step)
        loss_fn(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        sharded.stats.shard_group.end_step()
    return model, sharded, optimizer


def _row_bytes(numel: int, elem: int) -> int:
    """Bytes of one rank's row of `numel` elements, rounded up to 16 (NCCL alignment)."""
    return -(-numel * elem // 16) * 16


# ---- 1. shard sizes ---------------------------------------------------------------------------
def _shapes(rank: int, world_size: int, model_name: str, persistence_threshold: int) -> dict:
    torch.manual_seed(0)
    full = {name: p.numel() for name, p in MODELS[model_name][0]().named_parameters()}
    model, _, optimizer = _train(model_name, rank, world_size, steps=2, persistence_threshold=persistence_threshold)
    state = {}
    for name, param in model.named_parameters():
        state[name] = {k: tuple(v.shape) for k, v in optimizer.state[param].items() if v.dim() > 0}
    return {
        "full": full,
        "shapes": {name: tuple(p.shape) for name, p in model.named_parameters()},
        "grads": {name: tuple(p.grad.shape) if p.grad is not None else None for name, p in model.named_parameters()},
        "state": state,
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model_name", ["mlp", "tiny_gpt"])
def test_every_registered_parameter_is_a_1d_shard_of_ceil_numel_over_n(model_name, world_size):
    for result in run_ranks(_shapes, world_size, model_name, 0):
        expected = {name: (math.ceil(numel / world_size),) for name, numel in result["full"].items()}
        assert result["shapes"] == expected
        assert result["grads"] == expected, "gradients are not shard-sized"


def test_optimizer_state_is_shard_sized():
    """AdamW's exp_avg and exp_avg_sq are created from the shards, so they are 1/N too."""
    for result in run_ranks(_shapes, 3, "tiny_gpt", 0):
        for name, numel in result["full"].items():
            shard = (math.ceil(numel / 3),)
            assert result["state"][name] == {"exp_avg": shard, "exp_avg_sq": shard}, name


def test_parameters_at_or_below_persistence_threshold_stay_whole():
    for result in run_ranks(_shapes, 3, "mlp", 64):
        for name, numel in result["full"].items():
            if numel <= 64:
                assert math.prod(result["shapes"][name]) == numel, f"{name} ({numel}) was sharded"
                assert result["grads"][name] == result["shapes"][name], f"{name}'s gradient is not whole"
            else:
                assert result["shapes"][name] == (math.ceil(numel / 3),), f"{name} ({numel}) was not sharded"
        assert any(numel <= 64 for numel in result["full"].values()), "nothing was small enough to persist"


# ---- 3. communication per step ----------------------------------------------------------------
def _kept_for_backward(sharded) -> set[int]:
    """The units gathered once per step, by the rule of hooks.py's Note: kept for backward: the
    root, the last unit of the recorded forward order, and the units around it (TinyGPT's
    blocks.1 around blocks.1.mlp.2), whose forward ends after it."""
    assert sharded._schedule.forward_order is not None
    last = sharded._units[sharded._schedule.forward_order[-1]].module
    around = {u.uid for u in sharded._units if last in list(u.module.modules())}
    return {sharded._units[0].uid} | around


def _step_bytes(rank: int, world_size: int, model_name: str, prefetch: int, persistence_threshold: int = 0) -> dict:
    _, sharded, _ = _train(
        model_name, rank, world_size, steps=2, prefetch=prefetch, persistence_threshold=persistence_threshold
    )
    last = sharded.stats.shard_group.last_step
    kept = _kept_for_backward(sharded)
    units = [
        {
            "padded": sum(math.ceil(p.numel / world_size) for p in u.params),
            "numel": u.numel,
            "params": len(u.params),
            "kept": u.uid in kept,
        }
        for u in sharded._units
        if u.params
    ]
    return {
        "kinds": {kind: (b.calls, b.payload_bytes, b.wire_bytes) for kind, b in last.items() if b.calls},
        "expected": sharded.stats.expected_step_bytes(),
        "units": units,
    }


@pytest.mark.parametrize(
    ("model_name", "world_size", "prefetch"),
    [("mlp", 2, 0), ("mlp", 3, 2), ("tiny_gpt", 2, 1), ("tiny_gpt", 3, 1)],
)
def test_step_communication_is_two_gathers_and_one_reduce_scatter_of_every_unit(model_name, world_size, prefetch):
    """Steady state (step 2): forward All-Gather + backward All-Gather + Reduce-Scatter, each of
    every unit's padded parameters plus one tag element per rank, each rank's row rounded up to
    16 bytes; nothing else is sent. The root and the last unit are kept gathered from forward
    into backward: one All-Gather each. On the wire each rank sends (N-1)/N of the payload.
    Prefetching issues no extra gathers."""
    n, elem = world_size, 4  # fp32
    for result in run_ranks(_step_bytes, world_size, model_name, prefetch):
        units = result["units"]
        per_pass = sum(n * _row_bytes(u["padded"] + 1, elem) for u in units)  # one All-Gather of every unit
        psi = sum(u["numel"] for u in units)  # parameters, tied ones once
        # padding < N per param, then per rank and unit a tag and < 16 bytes of alignment
        overhead = sum(u["params"] * (n - 1) + n * (1 + 16 // elem) for u in units)
        assert psi * elem < per_pass <= (psi + overhead) * elem, "a pass does not move ~Psi elements"
        kept = [u for u in units if u["kept"]]
        assert len(kept) >= 2, "the root and the last block both hold parameters in these models"
        gathered = 2 * per_pass - sum(n * _row_bytes(u["padded"] + 1, elem) for u in kept)
        assert result["expected"] == {"all_gather": gathered, "reduce_scatter": per_pass}
        assert set(result["kinds"]) == {"all_gather", "reduce_scatter"}, f"other traffic: {result['kinds']}"
        gathers, gather_payload, gather_wire = result["kinds"]["all_gather"]
        reduces, reduce_payload, reduce_wire = result["kinds"]["reduce_scatter"]
        assert (gathers, reduces) == (2 * len(units) - len(kept), len(units))
        assert (gather_payload, reduce_payload) == (gathered, per_pass)
        assert gather_wire * n == gather_payload * (n - 1)
        assert reduce_wire * n == reduce_payload * (n - 1)


def test_frozen_units_and_persistent_parameters_send_what_expected_step_bytes_says():
    """A frozen block after a trainable one is gathered for forward and again for its backward
    (its input needs a gradient) but never reduced; small persistent parameters add one
    All-Reduce of their gradients. The formula accounts for both exactly."""
    for result in run_ranks(_step_bytes, 2, "mlp_frozen_block", 1, 16):
        measured = {kind: payload for kind, (_, payload, _) in result["kinds"].items()}
        assert "all_reduce" in measured and measured == result["expected"]
        gathers, reduces = result["kinds"]["all_gather"][0], result["kinds"]["reduce_scatter"][0]
        kept = sum(u["kept"] for u in result["units"])
        assert (gathers, reduces) == (2 * len(result["units"]) - kept, len(result["units"]) - 1)


# torch.distributed functions the engine may call per step, and what each does. The native
# collectives under either name (older releases, e.g. torch 2.6, have only the second spelling).
_PER_STEP_CALLS = {
    "broadcast": "in-place gather", "isend": "in-place reduce", "irecv": "in-place reduce",
    "all_reduce": "all-reduce",
    "all_gather_single": "native gather", "all_gather_into_tensor": "native gather",
    "reduce_scatter_single": "native reduce", "reduce_scatter_tensor": "native reduce",
}  # fmt: skip


@contextmanager
def _recording_dist_calls():
    """Record (name, bytes of the first tensor argument) of every call to the functions in
    `_PER_STEP_CALLS`, by wrapping them on torch.distributed: a count that is not the engine's."""
    import torch.distributed as dist

    calls: list[tuple[str, int]] = []
    originals = {name: getattr(dist, name) for name in _PER_STEP_CALLS if hasattr(dist, name)}

    def recording(name, fn):
        def wrapper(tensor, *args, **kwargs):
            calls.append((name, tensor.numel() * tensor.element_size()))
            return fn(tensor, *args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, recording(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _torch_distributed_calls(rank: int, world_size: int) -> dict:
    """What one step asks of torch.distributed: {name: (calls, bytes)}."""
    model, sharded, optimizer = _train("mlp", rank, world_size, steps=1, prefetch=1)
    x, y = mlp_batch(1)
    with _recording_dist_calls() as calls:
        out = model(local_slice(x, rank, world_size))
        torch.nn.functional.mse_loss(out, local_slice(y, rank, world_size)).backward()
        optimizer.step()
    units = [u for u in sharded._units if u.params]
    by_name: dict[str, tuple[int, int]] = {}
    for name, size in calls:
        count, total = by_name.get(name, (0, 0))
        by_name[name] = (count + 1, total + size)
    # Both collectives move the (N, S + 1) fp32 buffer of every unit (S + tag column), each
    # rank's row rounded up to 16 bytes.
    payload = sum(world_size * _row_bytes(u.shard_numel + 1, 4) for u in units)
    kept = [u for u in units if u.uid in _kept_for_backward(sharded)]
    kept_payload = sum(world_size * _row_bytes(u.shard_numel + 1, 4) for u in kept)
    return {"calls": by_name, "units": len(units), "payload": payload, "kept": len(kept), "kept_payload": kept_payload}


@pytest.mark.slow
def test_on_gloo_a_gather_is_one_broadcast_per_rank_and_a_reduce_scatter_sends_each_peer_its_row():
    """An independent count of what one step asks of torch.distributed on gloo (transport.py, Note:
    gloo): per unit and pass N in-place broadcasts covering the gathered buffer once; per unit
    reduced, N-1 sends and N-1 receives of one row each, i.e. (N-1)/N of the Reduce-Scatter's
    payload, what a ring would send. Nothing else on the per-step path."""
    for n in (2, 3):
        for result in run_ranks(_torch_distributed_calls, n):
            units, payload = result["units"], result["payload"]
            assert set(result["calls"]) == {"broadcast", "isend", "irecv"}, result["calls"]
            gathers = 2 * units - result["kept"]  # the root and the last unit: once (hooks.py, Note: kept for backward)
            assert result["calls"]["broadcast"] == (gathers * n, 2 * payload - result["kept_payload"])
            sent = payload * (n - 1) // n
            assert result["calls"]["isend"] == (units * (n - 1), sent)
            assert result["calls"]["irecv"] == (units * (n - 1), sent)


# ---- 4. units whole at once -------------------------------------------------------------------
def _peak_units(rank: int, world_size: int, prefetch: int) -> dict:
    _, sharded, _ = _train("deep_mlp", rank, world_size, steps=2, prefetch=prefetch)
    stats = sharded.stats.units
    return {"peak": stats.peak, "peak_without_root": stats.peak_without_root, "alive": stats.alive}


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_at_most_one_plus_prefetch_units_are_whole_besides_the_root(prefetch):
    """The root unit (what no block claims: here the input layer and the head) is whole for the
    entire forward and for the backward until its own gradients are reduced: the input layer is
    used first and the head last. Besides it, at most 1 + prefetch units hold whole parameters or
    an in-flight All-Gather at any time (measured on the second step, when prefetch is active,
    with 5 blocks); prefetch does use that headroom, and nothing is whole between steps."""
    for result in run_ranks(_peak_units, 2, prefetch):
        assert result["peak_without_root"] <= 1 + prefetch, f"more units whole than 1 + prefetch: {result}"
        assert result["peak_without_root"] == 1 + prefetch, f"prefetch did not gather ahead: {result}"
        assert result["peak"] == 2 + prefetch, f"the peak counting the root is not one more: {result}"
        assert result["alive"] == 0, f"units left whole after the step: {result}"


def test_peaks_reset_while_the_root_is_whole_leave_the_root_out_of_peak_without_root():
    """One process: peaks reset inside a block's forward (root and that block whole) then
    count 2 units, 1 without the root (was: 2 without the root, the root counted in)."""
    model = MLP()
    sharded = ShardedModel(model, prefetch=0)
    model.blocks[0].register_forward_pre_hook(lambda *_: sharded.stats.reset_peaks())
    with torch.no_grad():
        model(mlp_batch(0)[0])
    assert (sharded.stats.units.peak, sharded.stats.units.peak_without_root) == (2, 1)


# ---- 5. nothing kept between steps ------------------------------------------------------------
def _live_objects_per_step(rank: int, world_size: int, model_name: str) -> list[dict]:
    """Python objects alive after each step (collected first), by kind."""
    import gc

    from lightning_zero3.engine.calls import UnitCall

    counts = []
    for steps in (3, 6, 9):
        _train(model_name, rank, world_size, steps=0)  # warm caches alike before counting
        gc.collect()
        before_calls = sum(isinstance(o, UnitCall) for o in gc.get_objects())
        model, sharded, optimizer = _train(model_name, rank, world_size, steps=steps, prefetch=1)
        del model, sharded, optimizer
        gc.collect()
        objects = gc.get_objects()
        counts.append({
            "calls": sum(isinstance(o, UnitCall) for o in objects) - before_calls,
            "tensors": sum(isinstance(o, torch.Tensor) for o in objects),
            "objects": len(objects),
        })  # fmt: skip
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["mlp", "tiny_gpt"])
def test_training_steps_leave_no_unit_calls_or_tensors_behind(model_name):
    """Each forward of a unit creates a UnitCall holding its full tensors, whose autograd node
    refers back to it; nothing may keep those alive once the step and the model are gone (a
    reference cycle through autograd's C++ graph once leaked ~100 KB of them per step and
    fragmented the heap). Training 3, 6 or 9 steps leaves the same objects behind: none of the
    engine's, and no more tensors or objects for more steps."""
    for counts in run_ranks(_live_objects_per_step, 2, model_name):
        assert [c["calls"] for c in counts] == [0, 0, 0], counts
        assert len({c["tensors"] for c in counts}) == 1, counts
        assert counts[2]["objects"] - counts[0]["objects"] < 50, counts


# ---- 6. both ways of communicating ------------------------------------------------------------
def _trained_with(rank: int, world_size: int, model_name: str, gloo_in_place: bool) -> dict:
    factory, batch, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = factory()
    sharded = ShardedModel(model, prefetch=1)
    if not gloo_in_place:  # the transport NCCL gets (transport.py)
        sharded._comm.transport = NativeCollectives(sharded._comm.group, rank=sharded._comm.rank)
    # SGD: Adam would scale the rounding noise of gradients that are zero in exact arithmetic
    # (the attention's key bias) up to steps of size lr.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with _recording_dist_calls() as calls:
        for step in range(3):
            optimizer.zero_grad()
            x, y = batch(step)
            loss_fn(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            optimizer.step()
    used = {_PER_STEP_CALLS[name] for name, _ in calls}
    expected = {"in-place gather", "in-place reduce"} if gloo_in_place else {"native gather", "native reduce"}
    assert used == expected, used
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "calls": sharded.stats.shard_group.last_step,
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_native_collectives_and_gloo_in_place_ones_train_alike(world_size):
    """On CPU the engine gathers with broadcasts and reduces with send/recv (transport.py, Note:
    gloo); on GPUs it calls all_gather_single (in place: the input is the output's row) and
    reduce_scatter_single. Running the native path on gloo proves it here: same shard
    gradients and parameters after 3 SGD steps (bitwise at 2 ranks, where a sum of two does
    not depend on its order; to float rounding at 3) and the same counted bytes."""
    native = run_ranks(_trained_with, world_size, "tiny_gpt", False)
    in_place = run_ranks(_trained_with, world_size, "tiny_gpt", True)
    tol = 0.0 if world_size == 2 else 1e-6
    for a, b in zip(native, in_place):
        assert a["grads"].keys() == b["grads"].keys() and a["grads"]
        for name in a["params"]:
            assert (a["params"][name] - b["params"][name]).abs().max().item() <= tol, name
        for name in a["grads"]:
            assert (a["grads"][name] - b["grads"][name]).abs().max().item() <= tol, name
        assert a["calls"] == b["calls"]


def _bytes_of_each_step(rank: int, world_size: int) -> list[tuple[int, int]]:
    """(measured, formula for that step) All-Gather bytes of steps 1, 2 and 3."""
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pairs = []
    for step in range(3):
        x, y = mlp_batch(step)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
        sharded.stats.end_step()
        expected = sharded.stats.last_step_expected_bytes()
        assert expected is not None
        measured = sharded.stats.shard_group.last_step["all_gather"].payload_bytes
        pairs.append((measured, expected["all_gather"]))
    return pairs


def test_the_formula_reported_with_a_step_is_the_one_for_that_step():
    """The first step has no recorded order and keeps only the root whole into backward; from
    the second on the last block too. Each step's bytes sit next to the formula for that step."""
    for pairs in run_ranks(_bytes_of_each_step, 2):
        assert all(measured == formula for measured, formula in pairs), pairs
        assert pairs[0][0] > pairs[1][0] == pairs[2][0], "the first step gathers the last block once more"


def _one_rank_without_the_shortcut(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model, prefetch=1, reductions_in_flight=1)
    sharded._comm.one_rank_shortcut = False  # what benchmarks/gpu_check.py does on one GPU
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(2):
        step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
    return {"transport": type(sharded._comm.transport).__name__, "diff": max_param_difference(sharded, reference)}


def test_one_rank_without_the_local_shortcut_runs_real_native_collectives():
    """gloo's in-place Reduce-Scatter sums the rows of N >= 2 ranks (transport.py); one rank with the
    shortcut off takes the native collectives (was: an IndexError in the gloo sum)."""
    (result,) = run_ranks(_one_rank_without_the_shortcut, 1)
    assert result["transport"] == "NativeCollectives" and result["diff"] < 1e-6, result
