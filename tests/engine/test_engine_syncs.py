"""The engine reads device memory on the host at most once per training step (checks.py, Note:
deferred tag checks): every such read drains a GPU's queue and stops the CPU running ahead, so
prefetching could hide nothing. On CPU nothing really syncs, so the test counts the operations
that would: `aten._local_scalar_dense` (what `.item()`, `bool(t)`, `float(t)` and `int(t)`
dispatch to), `aten.is_nonzero`, `aten.equal`, copies from a non-CPU device to the CPU, and
`Tensor.tolist()` (which reads memory without dispatching)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_zero3.engine import ShardedModel
from tests.support.host_reads import counting_host_reads
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks


def _host_reads_per_step(rank: int, world_size: int, steps: int, options: dict | None = None) -> dict:
    """Host reads during each training step (forward, backward, optimizer step) of a 4-unit
    model (root + 3 blocks), then during `steps` evaluation passes in a row and the explicit
    check after them (a pass without backward is checked when the next pass starts)."""
    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model, prefetch=1, **(options or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    train = []
    x, y = mlp_batch(0)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    for _ in range(steps):
        with counting_host_reads() as reads:
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        train.append(reads.count)
    with counting_host_reads() as reads, torch.no_grad():
        for _ in range(steps):
            model(x)
        sharded._checks.check()  # what the next pass would do first
    return {"train": train, "eval": reads.count, "units": len(sharded._units)}


@pytest.fixture(scope="module")
def host_reads() -> list[dict]:
    """Each rank's host reads per training step and per evaluation pass (one run, two tests)."""
    return run_ranks(_host_reads_per_step, 2, 4)


def test_a_training_step_reads_device_memory_on_the_host_at_most_once(host_reads: list[dict]) -> None:
    """12 reads per step before the tags were checked on the device (3 per unit)."""
    for result in host_reads:
        assert result["units"] == 4
        # Step 1 records the order and checks every collective at once (it may sync freely).
        assert all(count <= 1 for count in result["train"][1:]), result


def test_quantized_collectives_add_no_host_read():
    """The codec's scales, codes and sums stay on the device (engine/quantize.py)."""
    options = {"quantize_weights": True, "quantize_gradients": "int4"}
    for result in run_ranks(_host_reads_per_step, 2, 4, options):
        assert all(count <= 1 for count in result["train"][1:]) and result["eval"] <= 4, result  # as unquantized


def test_an_evaluation_pass_reads_device_memory_on_the_host_at_most_once(host_reads: list[dict]) -> None:
    """4 reads per pass before (1 per unit)."""
    for result in host_reads:
        assert result["eval"] <= 4, result


class _Ops(TorchDispatchMode):
    """Counts the operations dispatched, by name: what a GPU launches kernels for."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _ops_per_gather_and_clip(rank: int, world_size: int, depth: int) -> dict:
    from lightning_zero3.engine import clip_grad_norm_

    torch.manual_seed(0)
    model = MLP(depth=depth)
    sharded = ShardedModel(model, prefetch=0)
    x, y = mlp_batch(0)
    with _Ops() as forward:
        loss = F.mse_loss(model(x), y)
    loss.backward()
    with _Ops() as clip:
        clip_grad_norm_(sharded, list(model.parameters()), 0.01)
    return {"copies": forward.names.count("split_with_sizes_copy"), "clip": [n for n in clip.names if n != "detach"]}


def test_copy_out_is_one_op_per_gather_and_clipping_a_fixed_number_of_ops():
    """Before: one copy per rank per gather, and ~3 ops per parameter to clip (a 3-block MLP's
    14 parameters against a 6-block one's 26)."""
    small, large = (run_ranks(_ops_per_gather_and_clip, 2, depth) for depth in (3, 6))
    for shallow, deep in zip(small, large):
        assert (shallow["copies"], deep["copies"]) == (4, 7), (shallow, deep)  # one per unit gathered in forward
        assert shallow["clip"] == deep["clip"], (shallow, deep)


def _clip_reads(rank: int, world_size: int) -> dict:
    from lightning_zero3.engine import clip_grad_norm_

    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model)
    x, y = mlp_batch(0)
    F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    params = list(model.parameters())
    ops = {}
    for check in (False, True):
        with _Ops() as clip:
            clip_grad_norm_(sharded, params, 1e6, error_if_nonfinite=check)
        ops[check] = [n for n in clip.names if n != "detach"]
    params[0].grad.fill_(float("inf"))
    with counting_host_reads() as reads, pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(sharded, params, 1.0, error_if_nonfinite=True)
    return {"ops": ops, "raising_reads": reads.count}


def test_checking_the_clipped_norm_is_finite_reads_it_once_and_launches_nothing_more():
    """Before: an `isfinite` kernel and a read of its result, then, to raise, a second read of
    the norm for the message (optim.py, `clip_grad_norm_`)."""
    for result in run_ranks(_clip_reads, 2):
        unchecked, checked = result["ops"][False], result["ops"][True]
        assert sorted(checked) == sorted([*unchecked, "_local_scalar_dense"]), result
        assert result["raising_reads"] == 1, result
