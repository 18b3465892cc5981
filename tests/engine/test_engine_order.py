"""Ranks that run different units (data-dependent control flow) get a clear error naming the
unit, on every rank, quickly: never a hang until the collective timeout, never gradients of two
same-size units silently mixed."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.checks import OrderMismatchError, RankChecks
from tests.support.models import MLP, RoutedMLP, mlp_batch
from tests.support.parity import local_slice, max_param_difference, step_side_by_side
from tests.support.ranks import RankFailure, run_ranks

# Collective timeout of the process group in these tests. A mismatch that is only noticed when
# a collective times out takes at least this long; a detected one takes a fraction of a second.
TIMEOUT_S = 20
ALL_BLOCKS = [0, 1, 2]


def _train_routed(rank: int, world_size: int, prefetch: int, routes: list[list[list[int]]]) -> str:
    """Train a RoutedMLP whose blocks run in `routes[step][rank]` order."""
    torch.manual_seed(0)
    model = RoutedMLP(depth=3)
    ShardedModel(model, prefetch=prefetch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, per_rank in enumerate(routes):
        model.route = per_rank[rank]
        x, y = mlp_batch(step)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


@pytest.fixture(scope="module", autouse=True)
def _started_ranks():
    """Start the rank launcher before any test measures how long it takes to fail."""
    run_ranks(_noop, 2)


def _noop(rank: int, world_size: int) -> None:
    return None


def _expect_clear_error(prefetch: int, routes: list[list[list[int]]]) -> str:
    start = time.perf_counter()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train_routed, 2, prefetch, routes, timeout_s=TIMEOUT_S)
    elapsed = time.perf_counter() - start
    text = str(failure.value)
    assert elapsed < TIMEOUT_S / 2, f"the mismatch was only noticed after {elapsed:.1f} s (a timeout):\n{text}"
    per_rank = re.split(r"--- rank \d+ ---\n", text)[1:]
    assert len(per_rank) == 2, f"not every rank raised:\n{text}"
    assert all(err.startswith("OrderMismatchError") for err in per_rank), f"not an OrderMismatchError:\n{text}"
    return text


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_block_skipped_on_one_rank_at_step_two_raises_naming_the_unit(prefetch):
    """Step 1 agrees (and is recorded); at step 2 rank 1 alone skips blocks.1."""
    routes = [[ALL_BLOCKS, ALL_BLOCKS], [ALL_BLOCKS, [0, 2]]]
    text = _expect_clear_error(prefetch, routes)
    assert "'blocks.1'" in text, f"the error does not name the skipped unit:\n{text}"


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_same_size_blocks_run_in_different_orders_raise_instead_of_mixing_gradients(prefetch):
    """blocks.0 and blocks.1 have the same size: without a check their parameters and gradients
    would be exchanged with each other silently. At step 2 rank 1 runs them swapped. Where the
    collectives first differ depends on what was prefetched, so the error names the units met
    there, one of which is a swapped block."""
    routes = [[ALL_BLOCKS, ALL_BLOCKS], [ALL_BLOCKS, [1, 0, 2]]]
    text = _expect_clear_error(prefetch, routes)
    assert "'blocks.0'" in text or "'blocks.1'" in text, f"the error does not name a swapped unit:\n{text}"


def test_different_order_on_the_first_step_raises_naming_both_units():
    routes = [[ALL_BLOCKS, [1, 0, 2]]]
    text = _expect_clear_error(1, routes)
    assert "'blocks.0'" in text and "'blocks.1'" in text, f"the error does not name both units:\n{text}"


def _train_routed_against_reference(rank: int, world_size: int, prefetch: int, routes: list[list[int]]) -> float:
    """Train a RoutedMLP whose route changes between steps, the same on every rank, next to a
    single-process reference; return the largest parameter difference."""
    torch.manual_seed(0)
    reference = RoutedMLP(depth=3)
    torch.manual_seed(0)
    model = RoutedMLP(depth=3)
    sharded = ShardedModel(model, prefetch=prefetch)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step, route in enumerate(routes):
        reference.route = model.route = route
        step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
    return max_param_difference(sharded, reference)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [1, 2])
def test_order_changed_on_every_rank_alike_is_followed_exactly(prefetch):
    """Departing from the recorded order is fine when every rank departs alike: units are
    gathered on demand, stale prefetches dropped, and the new order recorded."""
    routes = [ALL_BLOCKS, [0, 2], [1, 0, 2], [1, 0, 2], ALL_BLOCKS]
    for diff in run_ranks(_train_routed_against_reference, 3, prefetch, routes, timeout_s=TIMEOUT_S):
        assert diff < 1e-5, f"parameters differ from the reference by {diff:.3g}"


def test_last_block_skipped_on_one_rank_fails_fast_instead_of_hanging():
    """Rank 1 skips blocks.2, so its next collective has another size than rank 0's: no tag can
    be compared, gloo aborts the mismatched transfer. The test proves the run ends quickly with
    the failed collective named, never waiting for the collective timeout."""
    routes = [[ALL_BLOCKS, ALL_BLOCKS], [ALL_BLOCKS, [0, 1]]]
    start = time.perf_counter()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train_routed, 2, 0, routes, timeout_s=TIMEOUT_S)
    assert time.perf_counter() - start < TIMEOUT_S / 2
    text = str(failure.value)
    assert "CollectiveError" in text or "OrderMismatchError" in text, text


def _stall_in_backward(rank: int, world_size: int, stall_s: float) -> tuple[str, float]:
    """Rank 1 stalls inside backward, between blocks' gradients; what does rank 0 see?"""
    from tests.support.models import MLP

    torch.manual_seed(0)
    model = MLP()
    ShardedModel(model, prefetch=1)

    def stall(module, args, output):
        output.register_hook(lambda grad: time.sleep(stall_s))

    if rank == 1:
        model.blocks[0].register_forward_hook(stall)
    start = time.perf_counter()
    try:
        model(torch.randn(4, 7)).sum().backward()
    except Exception as err:  # what a rank raises is the result here
        return f"{type(err).__name__}: {err}", time.perf_counter() - start
    return "finished", time.perf_counter() - start


STALL_TIMEOUT_S, STALL_S = 2, 6


@pytest.fixture(scope="module")
def stalled_in_backward() -> list[tuple[str, float]]:
    """What each rank saw when rank 1 stalled `STALL_S` inside backward under a collective
    timeout of `STALL_TIMEOUT_S` (one run, read by the two tests below)."""
    return run_ranks(_stall_in_backward, 2, STALL_S, timeout_s=STALL_TIMEOUT_S)


@pytest.mark.slow
def test_rank_stalled_inside_backward_fails_the_others_after_the_timeout_naming_the_unit(
    stalled_in_backward: list[tuple[str, float]],
) -> None:
    """A rank that stops answering (alive, but stuck) while the others wait in a Reduce-Scatter
    (send/recv on gloo) must not hang them: they fail when the process group's timeout expires,
    with the unit named."""
    message, seconds = stalled_in_backward[0]
    assert message.startswith("CollectiveError: Reduce-Scatter of gradients of unit 'blocks.0'"), message
    assert STALL_TIMEOUT_S - 0.5 < seconds < STALL_S - 1, seconds


@pytest.mark.slow
def test_a_collective_timeout_names_the_last_collectives_and_the_recorded_order(
    stalled_in_backward: list[tuple[str, float]],
) -> None:
    """What a rank sees when a peer stops answering (on NCCL, also what ranks running units of
    different sizes end with; unit tags: tests/engine/test_engine_tags.py): the unit, this rank's last
    collectives, the recorded order and how to diagnose (TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    message = stalled_in_backward[0][0]
    assert "last collectives, oldest first: All-Gather of unit" in message, message
    # The first forward is recorded as soon as it ends (schedule.py): its order is named.
    assert "The recorded unit order, which every rank must follow: forward ['<root>', 'blocks.0'" in message, message
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in message, message


def test_the_first_backward_hands_its_recorded_orders_to_the_cross_rank_comparison_once() -> None:
    """One process: the first backward, and only it, compares the recorded orders (the backstop
    behind the tags, for positions no collective checks, e.g. units kept whole into backward)."""
    model = MLP()
    sharded = ShardedModel(model)
    compared = []
    sharded._checks.agree_on_orders = lambda comm, forward, backward: compared.append((forward, backward))  # type: ignore[method-assign]
    for step in range(3):
        x, y = mlp_batch(step)
        F.mse_loss(model(x), y).backward()
        assert len(compared) == 1, f"after backward {step}: {len(compared)} comparisons"  # from the first on
    assert compared == [(sharded._schedule.forward_order, sharded._schedule.backward_order)]


def test_recorded_orders_that_differ_between_ranks_raise_naming_the_position_and_both_units() -> None:
    class _World:  # every rank's (forward, backward), as all_gather_object returns them
        def all_gather_object(self, obj: object) -> list[object]:
            return [([1, 2], [2, 1]), ([1, 3], [3, 1])]

    checks = RankChecks(rank=0, names=["<root>", "a", "b", "c"])
    with pytest.raises(OrderMismatchError, match="forward orders: at position 1 rank 0 ran 'b' but rank 1 ran 'c'"):
        checks.agree_on_orders(_World(), [1, 2], [2, 1])  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_pass_that_leaves_the_record_announces_it_once(prefetch: int) -> None:
    """One process: an evaluation pass running the blocks in reverse (alike on every rank) leaves
    the training record once: one departure notice, then none (with prefetch=0 the pass stayed
    'on track' and announced again at every later position that differed: 5 more unit-size
    All-Gathers here)."""
    model = RoutedMLP(depth=6)
    sharded = ShardedModel(model, prefetch=prefetch)
    x, y = mlp_batch(0)
    F.mse_loss(model(x), y).backward()
    sharded.stats.end_step()
    model.route = [5, 4, 3, 2, 1, 0]
    with torch.no_grad():
        model(x)
    sharded.stats.end_step()
    units = len([u for u in sharded._units if u.params])
    # Every unit once, the notice, and with prefetch the one gather issued ahead and dropped.
    assert sharded.stats.shard_group.last_step["all_gather"].calls == units + 1 + prefetch
