"""What the buffer pool keeps (engine/buffers.py, Notes: size classes, what the pool keeps): a
whole-weights call leaves it as it found it, a training step holds the formula of
docs/accounting.md (Buffers a step holds), units of near sizes share buffers, and
`release_buffers` empties it. Measured by the pool's own bytes and by the storages alive."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, ShardingConfig
from lightning_zero3.engine.accounting import step_buffer_bytes
from lightning_zero3.engine.buffers import BufferPool, size_class, stream_api
from tests.support.cuda_standin import standin
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks


def live_storage_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach (after a collection), of 1
    KiB or more: the smallest pooled buffer here is 1.6 KiB, the engine's control scalars (tags,
    flags) a few bytes."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(n for n in storages.values() if n >= 1024)


def _storages_of(nbytes: int) -> int:
    """Distinct live storages of exactly `nbytes` bytes (no collection: buffers die by refcount)."""
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]
    return len({t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes() == nbytes})


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int, step: int) -> None:
    x, y = mlp_batch(step)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the dtype of bf16 gathers; a no-op in fp32
        loss = F.mse_loss(model(local_slice(x, rank, world_size)).float(), local_slice(y, rank, world_size))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _whole_weights_calls(rank: int, world_size: int) -> dict:
    """The path CUDA takes (streams registered), bf16 gathers: `full_state_dict` and
    `gathered_parameters` gather in fp32, buffers no training step uses."""
    with standin():
        torch.manual_seed(0)
        model = MLP(dim=64, depth=4)
        sharded = ShardedModel(model, param_dtype=torch.bfloat16, reductions_in_flight=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            _train(model, optimizer, rank, world_size, step)
        pool, x = sharded._pool, mlp_batch(0)[0]
        after_step = {"pooled": pool.cached_bytes, "live": live_storage_bytes()}
        bound = step_buffer_bytes(sharded._units, prefetch=1, in_flight=1, received=True)
        calls = {}

        def look(name: str, returned: list[torch.Tensor]) -> None:  # what the caller holds is not left behind
            live = live_storage_bytes() - sum(n for n in {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                                           for t in returned}.values() if n >= 1024)  # fmt: skip
            calls[name] = {"pooled": pool.cached_bytes, "taken": pool.taken_bytes, "live": live}

        with sharded.gathered_for_inference(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            inside = model(x).float()
        look("gathered_for_inference", [inside])
        full = sharded.full_state_dict(to_rank=None)
        look("full_state_dict", list(full.values()))
        with sharded.gathered_parameters():
            whole = {name: p.detach().clone() for name, p in model.named_parameters()}
        look("gathered_parameters", [*whole.values(), *full.values()])
        reference = MLP(dim=64, depth=4)
        reference.load_state_dict(full)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(x).float()
        pieces = [(full[sp.name].reshape(-1)[rank * sp.shard_numel :][: sp.shard_numel], sp.param.detach())
                  for sp in sharded.sharded_params]  # fmt: skip
        shard_diff = max(float((piece - shard[: piece.numel()]).abs().max()) for piece, shard in pieces)
        return {"after_step": after_step, "calls": calls, "bound": bound, "shard_diff": shard_diff,
                "inside_diff": float((inside - expected).abs().max())}  # fmt: skip


@pytest.fixture(scope="module")
def whole_weights_calls() -> list[dict]:
    return run_ranks(_whole_weights_calls, 2)


@pytest.mark.slow
def test_whole_weights_calls_leave_the_pool_as_the_training_step_left_it(whole_weights_calls) -> None:
    """After `gathered_for_inference()` (the whole model gathered), `full_state_dict()` and
    `gathered_parameters()` (fp32 gathers) the pool holds what the step left, no more, and within
    the step's peak (was: the whole model's buffers, for the rest of `fit`)."""
    for result in whole_weights_calls:
        step = result["after_step"]
        assert step["pooled"] <= result["bound"], result
        for name, seen in result["calls"].items():
            assert (seen["pooled"], seen["taken"]) == (step["pooled"], 0), (name, result)


def test_whole_weights_calls_leave_no_storage_alive(whole_weights_calls) -> None:
    """The same, on the storages alive (every tensor Python reaches), not the pool's counter."""
    for result in whole_weights_calls:
        for name, seen in result["calls"].items():
            assert seen["live"] == result["after_step"]["live"], (name, result)


def test_whole_weights_calls_give_the_shards_whole(whole_weights_calls) -> None:
    """Through buffers narrowed from their size class: `full_state_dict` holds each rank's shards
    exactly, and a forward inside `gathered_for_inference` is one process's on those weights."""
    for result in whole_weights_calls:
        assert result["shard_diff"] == 0.0, result
        assert result["inside_diff"] < 2e-2, result  # bf16 weights against autocast's casts of fp32 ones


def _buffers_of_a_step(rank: int, world_size: int, in_flight: int) -> dict:
    """Steady steps on the path CUDA takes, bf16 gathers: the Reduce-Scatter inputs (fp32, the
    only buffers of their size) alive when the forward ends and after each reduction starts."""
    with standin():
        torch.manual_seed(0)
        model = MLP(dim=64, depth=4)
        sharded = ShardedModel(model, param_dtype=torch.bfloat16, reductions_in_flight=in_flight)
        unit = sharded._units[1]
        inputs = unit.world_size * unit.reduce_row_numel * 4
        at_forward_end: list[int] = []
        in_backward: list[int] = []
        steady = lambda: sharded.stats.last_step_record is not None  # noqa: E731 - from the second step on
        model.head.register_forward_hook(lambda *_: at_forward_end.append(_storages_of(inputs)) if steady() else None)
        reductions = sharded._gradient_sync.reductions
        start = type(reductions).start

        def spy(self, unit, grads):  # noqa: ANN001, ANN202 - a spy on Reductions.start
            start(self, unit, grads)
            if steady():
                in_backward.append(_storages_of(inputs))

        reductions.start = spy.__get__(reductions)  # type: ignore[method-assign]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        peaks = []
        for step in range(3):
            sharded._pool.reset_peak()
            _train(model, optimizer, rank, world_size, step)
            sharded.stats.end_step()
            peaks.append(sharded._pool.peak_bytes)
        formula = step_buffer_bytes(sharded._units, prefetch=1, in_flight=in_flight, received=True)
        return {"forward": at_forward_end, "backward": max(in_backward), "peaks": peaks[1:], "formula": formula}


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [0, ShardingConfig().in_flight("cuda")], ids=["cpu_default", "cuda_default"])
def test_a_steady_step_holds_the_formulas_buffers(in_flight: int) -> None:
    """The pool's peak over a steady step is `step_buffer_bytes` (docs/accounting.md); with CUDA's
    default a backward holds the Reduce-Scatter input starting and one in flight (FSDP2's), and
    the forward none: with streams they go back to the allocator when a backward ends."""
    for result in run_ranks(_buffers_of_a_step, 2, in_flight):
        assert result["peaks"] == [result["formula"]] * 2, result
        assert result["backward"] == in_flight + 1, result
        assert set(result["forward"]) == {0}, result


def test_cuda_keeps_one_reduce_scatter_beyond_the_one_starting() -> None:
    assert ShardingConfig().in_flight("cuda") == 1 and ShardingConfig().in_flight("cpu") == 0


def test_a_buffer_serves_its_size_class_narrowed_to_the_elements_asked() -> None:
    """Requests within 1/8 of each other share a buffer of the widest (Note: size classes); the
    pool's bytes are the buffer's, not the request's."""
    pool, cpu = BufferPool(), torch.device("cpu")
    assert size_class(980) == size_class(1000) == size_class(1010)
    first = pool.take("block", 1000, torch.float32, cpu)
    pool.give("block", first)
    smaller = pool.take("block", 980, torch.float32, cpu)
    assert smaller.numel() == 980 and smaller.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert pool.taken_bytes == 4000
    pool.give("block", smaller.view(2, 490))  # any view of it comes back whole
    wider = pool.take("block", 1010, torch.float32, cpu)  # the free one is too small: replaced
    pool.give("block", wider)
    assert pool.bytes() == {"pooled": 4040, "taken": 0, "peak": 4040}


def test_units_of_near_sizes_share_one_block() -> None:
    """Two units 3% apart in size (1,640 and 1,599 elements): one block, one receive buffer and
    one Reduce-Scatter input serve both (were one of each per unit)."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 39), torch.nn.Linear(39, 1))
    sharded = ShardedModel(model, wrap_policy={torch.nn.Linear}, prefetch=0)  # one process
    a, b = sharded._units[1], sharded._units[2]
    assert size_class(a.block_numel) == size_class(b.block_numel) and a.block_numel != b.block_numel
    model(torch.randn(4, 40)).sum().backward()
    pooled = [(role, buf.numel()) for (role, size, *_), free in sharded._pool._free.items() for buf, _ in free
              if size == size_class(a.block_numel)]  # fmt: skip
    rows = a.row_numel(), a.reduce_row_numel  # one process: a receive buffer is one row
    assert sorted(pooled) == [("block", a.block_numel), ("gather", rows[0]), ("reduce", rows[1])], pooled


def test_a_buffer_let_go_is_first_waited_for_by_the_stream_that_allocated_it() -> None:
    """CUDA's caching allocator hands a freed buffer to the next allocation on the stream that
    allocated it: before the pool lets one go, that stream waits for the event of its last use
    (buffers.py, Note: buffer roles and streams), with no host wait and no `record_stream`."""
    with standin() as mode:
        cpu = torch.device("cpu")
        api, pool = stream_api(cpu), BufferPool()
        copy_in = api.Stream()
        with api.stream(copy_in):
            buffer = pool.take("gather", 64, torch.float32, cpu)  # allocated on copy_in
            buffer.fill_(1.0)
        api.current_stream().wait_stream(copy_in)
        buffer.add_(1.0)  # its last use, on the compute stream
        pool.give("gather", buffer)
        api.edges.clear()
        pool.empty()
        assert ("wait_event", copy_in.name, "default") in api.edges, api.edges
        assert mode.counts["host_reads"] == 0 and not mode.races, (mode.counts, mode.races)


def _release(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = MLP(dim=64, depth=4)
    sharded = ShardedModel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, optimizer, rank, world_size, 0)
    before = (sharded._pool.cached_bytes, live_storage_bytes())
    sharded.release_buffers()
    after = (sharded._pool.cached_bytes, live_storage_bytes())
    _train(model, optimizer, rank, world_size, 1)  # the next step makes them again
    return {"before": before, "after": after, "again": sharded._pool.cached_bytes}


@pytest.mark.slow
def test_release_buffers_gives_every_pooled_buffer_back() -> None:
    for result in run_ranks(_release, 2):
        (pooled, live), (pooled_after, live_after) = result["before"], result["after"]
        assert pooled > 0 and pooled_after == 0, result
        assert live - live_after == pooled, result  # the storages went, not only the counter
        assert result["again"] == pooled, result
