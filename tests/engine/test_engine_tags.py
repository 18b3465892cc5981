"""Unit tags (unit.py, Note: flat layout; checks.py): exact in every dtype and at any
world size, and a rank that leaves the recorded order alone ends, like every other rank, with an
`OrderMismatchError` naming the unit, even when the units differ in size."""

from __future__ import annotations

import re
import time
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.checks import OrderMismatchError, RankChecks, exact_integers
from lightning_zero3.engine.unit import Unit
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice, max_param_difference, step_side_by_side
from tests.support.ranks import RankFailure, run_ranks

TIMEOUT_S = 20


def _float64_parity(rank: int, world_size: int) -> float:
    torch.manual_seed(0)
    reference = MLP().double()
    torch.manual_seed(0)
    model = MLP().double()
    sharded = ShardedModel(model, prefetch=1)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step in range(3):
        x, y = mlp_batch(step)
        step_side_by_side(reference, model, optimizers, (x.double(), y.double()), rank, world_size)
    return max_param_difference(sharded, reference)


def test_a_float64_model_trains_like_one_process():
    """The gather tag's 32 bits fill one float64 element (it used to fail on int32 -> float64)."""
    for diff in run_ranks(_float64_parity, 2):
        assert diff < 1e-12, diff


@pytest.mark.parametrize(("dtype", "world_size"), [(torch.bfloat16, 300), (torch.float16, 2100)])
def test_the_reduce_scatter_check_column_is_exact_beyond_what_16_bit_floats_count(dtype, world_size):
    """bf16 holds every integer only up to 256 and fp16 up to 2048: a column that sums one
    number per rank saturates in large jobs and would report a false mismatch. Each rank's
    column holds its code in one row and zeros elsewhere, so every sum, in any order, is exact."""
    assert exact_integers(dtype) < world_size
    uid = 1000  # more units than the 16-bit dtype counts: codes wrap, still exact
    checks = RankChecks(rank=0, names=[])
    columns = []
    for rank in range(world_size):  # what each rank sends, per destination
        column = torch.full((world_size,), float("nan"), dtype=dtype)
        assert checks.stamp_reduce(column, uid, rank)
        columns.append(column)
    column = torch.stack(columns)  # (sender, destination)
    code = checks.reduce_code(uid, dtype)
    assert 1 <= code < exact_integers(dtype)
    for destination in (0, 1, world_size // 2, world_size - 1):
        total = torch.zeros((), dtype=dtype)
        for sender in torch.randperm(world_size).tolist():  # a ring adds in some order
            total = total + column[sender, destination]
        assert total.item() == code, (destination, total.item())


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(13, hidden), nn.Linear(hidden, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class SizedBlocks(nn.Module):
    """Blocks of different sizes (hidden widths 5, 9, 17) run in `route` order."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList(_Block(hidden) for hidden in (5, 9, 17))
        self.head = nn.Linear(13, 5)
        self.route = [0, 1, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for index in self.route:
            h = self.blocks[index](h)
        return self.head(h)


def _train_sized(rank: int, world_size: int, prefetch: int, routes: list[list[list[int]]]) -> str:
    torch.manual_seed(0)
    model = SizedBlocks()
    ShardedModel(model, prefetch=prefetch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, per_rank in enumerate(routes):
        model.route = per_rank[rank]
        x, y = mlp_batch(step)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_rank_skipping_a_block_of_another_size_fails_on_every_rank_naming_it(prefetch):
    """Rank 1 alone skips blocks.1 at step 2, so its next unit differs in size from the others':
    gloo used to abort the mismatched transfer (exit 134, no Python error) on one rank. Now it
    announces the departure in the collective the others issue, and every rank raises."""
    routes = [[[0, 1, 2], [0, 1, 2]], [[0, 1, 2], [0, 2]]]
    start = time.perf_counter()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train_sized, 2, prefetch, routes, timeout_s=TIMEOUT_S)
    text = str(failure.value)
    assert time.perf_counter() - start < TIMEOUT_S / 2, text
    per_rank = re.split(r"--- rank \d+ ---\n", text)[1:]
    assert len(per_rank) == 2 and all(err.startswith("OrderMismatchError") for err in per_rank), text
    assert all("'blocks.2'" in err and "departed" in err for err in per_rank), text


def _departing_alike(rank: int, world_size: int, prefetch: int) -> float:
    torch.manual_seed(0)
    reference = SizedBlocks()
    torch.manual_seed(0)
    model = SizedBlocks()
    sharded = ShardedModel(model, prefetch=prefetch)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for step, route in enumerate([[0, 1, 2], [0, 2], [2, 1, 0], [0, 1, 2]]):
        reference.route = model.route = route
        step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
    return max_param_difference(sharded, reference)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_rank_leaving_the_order_alike_still_trains_exactly(prefetch):
    for diff in run_ranks(_departing_alike, 2, prefetch, timeout_s=TIMEOUT_S):
        assert diff < 1e-5, diff


def mislabel(unit: Unit, as_unit: Unit) -> None:
    """`unit`'s gathers carry `as_unit`'s tag from now on (a wrong pairing, as seen on the wire)."""
    unit.start_gather = partial(Unit.start_gather, unit, tag=as_unit.checks.tag(as_unit.uid))  # type: ignore[method-assign]


def _tampered_tag(rank: int, world_size: int) -> str:
    """Rank 1 labels blocks.1 as blocks.2 from step 2 on: the ranks follow the same order, but
    their collectives now pair different units of the same size (what a wrong pairing looks like
    on the wire), and no collective fails."""
    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model, prefetch=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        if step == 1 and rank == 1:
            by_name = {unit.name: unit for unit in sharded._units}
            mislabel(by_name["blocks.1"], by_name["blocks.2"])
        x, y = mlp_batch(step)
        loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        try:
            loss.backward()
        except RuntimeError as err:
            return f"backward raised {type(err).__name__}: {err}"
        optimizer.step()
        optimizer.zero_grad()
    return "finished"


def test_a_mismatched_step_raises_out_of_backward_before_the_optimizer_step():
    """The deferred check runs at the end of backward: gradients of a mismatched step never
    reach the optimizer."""
    for outcome in run_ranks(_tampered_tag, 2, timeout_s=TIMEOUT_S):
        assert outcome.startswith("backward raised OrderMismatchError"), outcome
        assert "'blocks.1'" in outcome, outcome


class _Leaf(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Linear(hidden, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _Outer(nn.Module):
    """A unit with two nested units of different sizes; `use_w` picks which one runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.v, self.w = _Leaf(4), _Leaf(13)
        self.use_w = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.w(h) if self.use_w else self.v(h)


class _OuterTwice(nn.Module):
    """Forward order [root, u, u.v, u, u.v]: `u` is open while `u.v` runs and called again next."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.u = _Outer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.u(self.inp(x)))


def _departure_inside_an_outer_unit(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = _OuterTwice()
    ShardedModel(model, wrap_policy=lambda m: isinstance(m, (_Outer, _Leaf)), prefetch=1)
    model(torch.randn(4, 8)).sum().backward()
    model.u.use_w = rank == 1  # rank 1 runs u.w where the record has u.v
    try:
        model(torch.randn(4, 8)).sum().backward()
    except OrderMismatchError as err:
        return str(err)
    return "no error"


def test_a_departure_where_the_next_recorded_unit_is_held_still_raises_on_every_rank():
    """Rank 1 departs inside `u`, and the record's next unit is `u` again, which rank 1 holds.
    The others' next All-Gather is that `u`: rank 1 announces in it (was: skipped because it
    held `u`, so its gather of u.w met their gather of u, a size mismatch gloo aborts on)."""
    for message in run_ranks(_departure_inside_an_outer_unit, 2, timeout_s=TIMEOUT_S):
        assert "mismatch" in message and "'u.w' (departed from the recorded order)" in message, message
