"""`ShardingConfig(rank_checks=...)` (engine/checks.py, Note: rank check modes): the checks that
turn ranks running different units into an `OrderMismatchError` run on every step, on the first
only, or on every K-th; on the steps they skip, no tag is stamped or read and the host is never
read, and on the steps they run, a mislabelled collective still fails on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, ShardingConfig
from tests.engine.test_engine_tags import mislabel
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice, max_param_difference, step_side_by_side
from tests.support.ranks import RankFailure, run_ranks

STEPS = 6


@pytest.mark.parametrize("value", ["sometimes", 0, -2, True, 1.5, None])
def test_an_unknown_rank_checks_value_is_refused_naming_the_choices(value):
    expected = r"ShardingConfig\(rank_checks=...\) must be \"every_step\", \"first_step\" or an int K >= 1"
    with pytest.raises(ValueError, match=expected):
        ShardingConfig(rank_checks=value)


def _reads_per_step(rank: int, world_size: int, rank_checks: str | int) -> dict:
    torch.manual_seed(0)
    reference = MLP()
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model, prefetch=1, rank_checks=rank_checks)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    stamped = []
    original = type(sharded._checks).stamp_gather

    def counting(checks, slot, tag):  # noqa: ANN001 - a spy on the method
        done = original(checks, slot, tag)
        stamped[-1] += done
        return done

    sharded._checks.stamp_gather = counting.__get__(sharded._checks)  # type: ignore[method-assign]
    tolist = torch.Tensor.tolist
    calls = []

    def counted_tolist(self):  # noqa: ANN001
        calls[-1] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    reads, tags = [], []
    try:
        for step in range(STEPS):
            before = (sharded._checks.host_reads, sharded._checks.tags_read)
            stamped.append(0)
            calls.append(0)
            step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
            reads.append(sharded._checks.host_reads - before[0])
            tags.append(sharded._checks.tags_read - before[1])
        stamped.append(0)  # what follows (full_state_dict) is not a step's
        calls.append(0)
    finally:
        torch.Tensor.tolist = tolist
    return {"reads": reads, "tags": tags, "stamped": stamped, "tolist": calls,
            "diff": max_param_difference(sharded, reference)}  # fmt: skip


@pytest.mark.parametrize(
    ("rank_checks", "checked"),
    [("every_step", [0, 1, 2, 3, 4, 5]), ("first_step", [0]), (3, [0, 3]), (1, [0, 1, 2, 3, 4, 5])],
)
def test_unchecked_steps_stamp_nothing_read_no_tags_and_never_read_the_host(rank_checks, checked):
    for result in run_ranks(_reads_per_step, 2, rank_checks):
        assert result["diff"] < 1e-5, result  # the checks change no value
        for step in range(STEPS):
            on = step in checked
            assert (result["stamped"][step] > 0) == on, result
            assert (result["tags"][step] > 0) == on, result
            assert (result["tolist"][step] > 0) == on, result
            # A checked steady step reads the host once (the deferred check); the first step
            # watches closely (no order recorded yet: one read per collective).
            if on and step > 0:
                assert result["reads"][step] == 1, result
            if not on:
                assert result["reads"][step] == 0, result
        assert result["reads"][0] > 1, result


def _mislabelled_at(rank: int, world_size: int, rank_checks: str | int, bad_step: int) -> str:
    """Rank 1 labels blocks.1 as blocks.2 from `bad_step` on (a wrong pairing, as on the wire)."""
    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model, prefetch=1, rank_checks=rank_checks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        if step == bad_step and rank == 1:
            by_name = {unit.name: unit for unit in sharded._units}
            mislabel(by_name["blocks.1"], by_name["blocks.2"])
        x, y = mlp_batch(step)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


@pytest.mark.slow
def test_a_checked_step_still_fails_on_every_rank_and_an_unchecked_one_does_not_look():
    """K=2: a mislabel at step 2 (checked) raises OrderMismatchError on both ranks; at step 1
    (not checked), it goes unseen until step 2 checks it. "first_step" never looks again."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_mislabelled_at, 2, 2, 2, timeout_s=30)
    per_rank = str(failure.value).split("--- rank")[1:]
    assert len(per_rank) == 2 and all("OrderMismatchError" in text and "'blocks.1'" in text for text in per_rank)
    with pytest.raises(RankFailure, match="OrderMismatchError"):
        run_ranks(_mislabelled_at, 2, 2, 1, timeout_s=30)  # unseen at step 1, caught at step 2
    assert run_ranks(_mislabelled_at, 2, "first_step", 1, timeout_s=30) == ["finished", "finished"]
