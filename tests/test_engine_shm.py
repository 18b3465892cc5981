"""The shared-memory transport (engine/shm.py, Note: shared-memory transport): the same results
bit for bit as gloo, the same byte counts, the same unit-tag checks, and a clear error on every
rank (never a SIGBUS, a hang or a file left in /dev/shm) where it cannot be set up."""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from tests.models import MLP, mlp_batch
from tests.parity import local_slice
from tests.ranks import RankFailure, run_ranks
from tests.test_engine_tags import _tampered_tag

TIMEOUT_S = 20
PREFIX = "lightning_zero3-"


def _train(rank: int, world_size: int, transport: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model, prefetch=1, cpu_transport=transport)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = mlp_batch(step)
        loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sharded.end_step()
        losses.append(loss.item())
    stats = sharded.stats.last_step
    return {
        "losses": losses,
        "shards": [p.detach().clone() for p in model.parameters()],
        "bytes": {k: (v.calls, v.payload_bytes, v.wire_bytes) for k, v in stats.items() if k != "object"},
        "shared_collectives": sharded.comm.shared.sequence if sharded.comm.shared is not None else 0,
        "gather_wait_s": sharded.stats.last_step_gather_wait_s,
    }


def _both_transports(rank: int, world_size: int) -> tuple[dict, dict]:
    return _train(rank, world_size, "process_group", 4), _train(rank, world_size, "shared_memory", 4)


def test_three_ranks_train_bitwise_alike_through_shared_memory_and_gloo():
    """Three ranks, so that the order of the Reduce-Scatter's additions shows in the bits."""
    for gloo, shm in run_ranks(_both_transports, 3, timeout_s=TIMEOUT_S):
        assert gloo["losses"] == shm["losses"]
        assert all(torch.equal(a, b) for a, b in zip(gloo["shards"], shm["shards"]))
        assert gloo["shared_collectives"] == 0
        per_step = shm["bytes"]["all_gather"][0] + shm["bytes"]["reduce_scatter"][0]
        # Every gather and reduction went through it: 4 steps like the last, plus the first
        # step's backward gather of the last block (no order recorded yet, so it was not kept:
        # engine/hooks.py, Note: kept for backward).
        assert shm["shared_collectives"] == 4 * per_step + 1


def test_bytes_are_counted_alike_on_both_transports():
    """'wire' on shared memory: what the other ranks read of this rank's data, (N-1)/N of the
    payload, as for the ring (comm.py)."""
    for gloo, shm in run_ranks(_both_transports, 2, timeout_s=TIMEOUT_S):
        assert gloo["bytes"] == shm["bytes"]
        assert shm["bytes"]["all_gather"][1] > 0


def _one_step_through_shared_memory(rank: int, world_size: int) -> dict:
    return _train(rank, world_size, "shared_memory", 1)


def test_time_blocked_in_shared_memory_gathers_is_counted_as_gather_wait():
    """The transport blocks at issue, not in `wait`: a wait of 0 would claim prefetch hid it all."""
    for result in run_ranks(_one_step_through_shared_memory, 2, timeout_s=TIMEOUT_S):
        assert result["gather_wait_s"] > 0


def _no_shm_file_of(pid: int) -> bool:
    return not any(name.startswith(f"{PREFIX}{pid}-") for name in os.listdir("/dev/shm"))


def _set_up(rank: int, world_size: int) -> tuple[int, bool]:
    ShardedModel(MLP(depth=2), cpu_transport="shared_memory")
    return os.getpid(), _no_shm_file_of(os.getpid())


def test_the_shared_file_is_gone_from_dev_shm_once_every_rank_mapped_it():
    """Unlinked at setup: no rank's death can leave it behind."""
    (pid, gone), _ = run_ranks(_set_up, 2, timeout_s=TIMEOUT_S)
    assert gone
    assert _no_shm_file_of(pid)


def _arena(rank: int, world_size: int, set_bytes: int, fail: str) -> str:
    from lightning_zero3.engine import shm
    from lightning_zero3.engine.comm import Comm

    if fail == "fallocate" and rank == 0:

        def no_space(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        os.posix_fallocate = no_space  # type: ignore[assignment]
    if fail == "map" and rank == 1:

        def cannot_map(*args: object, **kwargs: object) -> None:
            raise RuntimeError("mmap refused")

        torch.UntypedStorage.from_file = cannot_map  # type: ignore[method-assign]
    if fail == "die" and rank == 1:
        torch.UntypedStorage.from_file = lambda *a, **k: os._exit(3)  # type: ignore[method-assign]
    if fail == "die before mapping" and rank == 1:  # rank 0 has created the file, not yet sent its name
        exchange, calls = Comm.all_gather_object, []

        def dies_at_the_second_exchange(self: Comm, obj: object) -> list[object]:
            calls.append(obj)
            if len(calls) == 2:
                os._exit(3)
            return exchange(self, obj)

        Comm.all_gather_object = dies_at_the_second_exchange  # type: ignore[method-assign]
    if fail == "host" and rank == 1:
        shm.host_identity = lambda: "elsewhere/1"  # type: ignore[assignment]
    try:
        Comm().use_shared_memory(set_bytes)
    except shm.SharedMemoryError as err:
        return f"SharedMemoryError: {err}"
    return "set up"


@pytest.mark.parametrize(
    ("fail", "set_bytes", "expected"),
    [
        ("none", 1 << 50, r"/dev/shm has [\d,]+ bytes free, the transport needs [\d,]+"),  # statvfs says no
        ("fallocate", 1 << 20, r"could not reserve 2,097,152 bytes in /dev/shm: .*No space left"),
        ("map", 1 << 20, r"rank 1 could not map /dev/shm/lightning_zero3-\d+-\w+: mmap refused"),
    ],
)
def test_a_dev_shm_that_cannot_hold_the_arena_fails_on_every_rank_naming_the_fix(fail, set_bytes, expected):
    before = {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)}
    for outcome in run_ranks(_arena, 2, set_bytes, fail, timeout_s=TIMEOUT_S):
        assert outcome.startswith("SharedMemoryError: The shared-memory transport could not be set up"), outcome
        assert re.search(expected, outcome), outcome
        assert "cpu_transport='process_group'" in outcome, outcome
    assert {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)} <= before


@pytest.mark.parametrize("fail", ["die", "die before mapping"])
def test_a_rank_dying_during_setup_leaves_no_file_in_dev_shm(fail):
    before = {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)}
    with pytest.raises(RankFailure) as failure:
        run_ranks(_arena, 2, 1 << 20, fail, timeout_s=5)
    assert "exited with code 3" in str(failure.value), str(failure.value)
    assert {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)} <= before


def test_ranks_on_different_hosts_are_refused_on_every_rank():
    for outcome in run_ranks(_arena, 2, 1 << 20, "host", timeout_s=TIMEOUT_S):
        assert outcome.startswith("SharedMemoryError: The shared-memory transport needs every rank"), outcome
        assert "rank 1: elsewhere" in outcome, outcome
        assert "cpu_transport='process_group'" in outcome, outcome


def test_ranks_gathering_different_units_through_shared_memory_fail_naming_the_unit():
    for outcome in run_ranks(_tampered_tag, 2, "shared_memory", timeout_s=TIMEOUT_S):
        assert outcome.startswith("backward raised OrderMismatchError"), outcome
        assert "'blocks.1'" in outcome, outcome


def test_an_unknown_transport_is_refused_at_construction():
    from lightning_zero3 import ZeRO3Strategy

    with pytest.raises(ValueError, match=r"ZeRO3Strategy\(cpu_transport=...\) must be one of"):
        ZeRO3Strategy(cpu_transport="tcp")  # type: ignore[arg-type]


def _out_of_step(rank: int, world_size: int, case: str = "one more") -> str:
    from lightning_zero3.engine.comm import CollectiveError, Comm

    comm = Comm()
    comm.use_shared_memory(1 << 16)
    assert comm.shared is not None
    width = 8
    if case == "one more" and rank == 1:
        comm.shared.sequence += 1  # as if rank 1 had run one shared-memory collective more
    if case == "summing alike":
        comm.shared.sequence += rank  # 0, 1, 2: they sum as three 1s, what rank 1 expects of a sum
    if case == "another size" and rank == 1:
        width = 4  # the same collective number, a different (smaller) unit: both fit the arena
    try:
        comm.all_gather(torch.zeros(world_size * width), torch.ones(width), async_op=False, what="unit 'u'")
    except CollectiveError as err:
        return str(err)
    return "gathered"


def test_ranks_out_of_step_on_the_shared_slots_raise_instead_of_reading_unwritten_ones():
    for outcome in run_ranks(_out_of_step, 2, timeout_s=TIMEOUT_S):
        assert outcome.startswith("All-Gather of unit 'u' failed on rank"), outcome
        assert "met a rank at another collective" in outcome, outcome


def test_ranks_out_of_step_raise_on_every_rank_even_where_their_sequence_numbers_sum_as_if_in_step():
    """Rank 1 (at 1 of 0, 1, 2) must not go on alone and hang at its next collective."""
    for outcome in run_ranks(_out_of_step, 3, "summing alike", timeout_s=TIMEOUT_S):
        assert "met a rank at another collective" in outcome, outcome
        assert "at shared-memory collectives 0 to 2" in outcome, outcome


def test_ranks_at_one_shared_collective_with_different_sizes_raise_instead_of_reading_stale_rows():
    """Rank 0 would read rank 1's row where a collective two before left rows of its own size."""
    for outcome in run_ranks(_out_of_step, 2, "another size", timeout_s=TIMEOUT_S):
        assert outcome.startswith("All-Gather of unit 'u' failed on rank"), outcome
        assert "of 32 to 64 bytes" in outcome, outcome


def _interleaved(rank: int, world_size: int) -> tuple[list[list[float]], int]:
    from lightning_zero3.engine.comm import Comm

    comm = Comm()
    comm.use_shared_memory(64)  # one slot set: 16 fp32, i.e. rows of 8 at 2 ranks
    assert comm.shared is not None
    big = torch.zeros(world_size * 32)
    work = comm.all_gather(big, torch.full((32,), float(rank)), async_op=True, what="big")  # gloo, left in flight
    small = [torch.zeros(world_size * 8) for _ in range(3)]
    for k, out in enumerate(small):
        comm.all_gather(out, torch.full((8,), 10.0 * k + rank), async_op=True, what="small")
    comm.wait(work)
    return [t.view(world_size, -1)[:, 0].tolist() for t in (big, *small)], comm.shared.sequence


def test_a_gather_too_large_for_the_arena_goes_through_gloo_in_flight_between_shared_memory_ones():
    for rows, shared_collectives in run_ranks(_interleaved, 2, timeout_s=TIMEOUT_S):
        assert rows == [[0.0, 1.0], [0.0, 1.0], [10.0, 11.0], [20.0, 21.0]]
        assert shared_collectives == 3  # the three small ones; the large one did not use a slot set
