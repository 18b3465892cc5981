"""`ShardingConfig(rank_checks=...)` (engine/checks.py, Note: rank check modes): the checks that
turn ranks running different units into an `OrderMismatchError` run on every step, on the first
only, or on every K-th; on the steps they skip, no tag is stamped or read and the host is never
read, and on the steps they run, a mislabelled collective still fails on every rank. No steady
step reads the host, checked or not (Note: deferred tag checks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, ShardingConfig
from lightning_zero3.engine.checks import OrderMismatchError
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
            # No steady step reads the host, checked or not: the tags go by a non-blocking copy
            # (checks.py, Note: deferred tag checks); the first step watches closely (no order
            # recorded yet: one read per collective).
            if step > 0:
                assert result["reads"][step] == 0 and result["tolist"][step] == 0, result
        assert result["reads"][0] > 1 and result["tolist"][0] > 1, result


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


def _mislabelled_on_a_device_a_step_behind(rank: int, world_size: int) -> str:
    """As `_mislabelled_at(..., "every_step", 2)`, on the path CUDA takes, with a device whose
    work never has finished when the host asks (events never pass a query)."""
    from tests.support.cuda_standin import FakeEvent, standin

    FakeEvent.query = lambda self: False  # type: ignore[method-assign]  # this rank's process only
    torch.manual_seed(0)
    with standin():
        model = MLP(depth=3)
        sharded = ShardedModel(model, prefetch=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            if step == 2 and rank == 1:
                by_name = {unit.name: unit for unit in sharded._units}
                mislabel(by_name["blocks.1"], by_name["blocks.2"])
            x, y = mlp_batch(step)
            try:
                F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            except OrderMismatchError as err:
                return f"step {step}: {err}"
            optimizer.step()
            optimizer.zero_grad()
    return "finished"


def test_a_mismatch_read_without_waiting_raises_one_step_later_on_every_rank():
    """Steady steps send their tags to the host and never wait for them (checks.py, Note: deferred
    tag checks): where the copy has not landed by the next backward's end, it is waited for there,
    so the mismatch of step 2 raises at step 3, on every rank, saying so. Before: no such case (a
    sync at every step's end)."""
    for outcome in run_ranks(_mislabelled_on_a_device_a_step_behind, 2, timeout_s=30):
        assert outcome.startswith("step 3: All-Gather mismatch") and "'blocks.1'" in outcome, outcome
        assert "(read 1 backward(s) later: checks.py, Note: deferred tag checks)" in outcome, outcome


def _last_batch_of_rank_0_on_a_device_a_step_behind(rank: int, world_size: int) -> str:
    """Rank 0 runs the last batch of its epoch at step 2 (`final_batch`, set by the strategy),
    rank 1 has more; events never pass a query, as in the test above."""
    from tests.support.cuda_standin import FakeEvent, standin

    FakeEvent.query = lambda self: False  # type: ignore[method-assign]  # this rank's process only
    torch.manual_seed(0)
    with standin():
        model = MLP(depth=3)
        sharded = ShardedModel(model, prefetch=1)
        for step in range(4):
            sharded._checks.final_batch = step == 2 and rank == 0
            x, y = mlp_batch(step)
            try:
                F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            except (OrderMismatchError, RuntimeError) as err:
                return f"step {step}: {type(err).__name__}: {err}"
    return "finished"


def test_the_step_of_a_ranks_last_batch_is_checked_at_once_even_where_reads_wait_for_nothing():
    """checks.py, Note: uneven batches: the rank whose epoch ends raises at that step (it would
    otherwise go on to a pass the others never run); the rank with more batches reads late and
    learns it from its next collective."""
    short, long = run_ranks(_last_batch_of_rank_0_on_a_device_a_step_behind, 2, timeout_s=10)
    assert short.startswith("step 2: OrderMismatchError: Uneven batch counts"), short
    assert long.startswith("step 3:") and "Uneven batch counts" in long, long
