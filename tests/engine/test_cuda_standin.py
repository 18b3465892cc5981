"""The engine's CUDA code path, run on CPU through the stand-in for CUDA's streams and ordering
rules (tests/support/cuda_standin.py; engine/buffers.py, Note: stream seam): no read on one stream of what
another wrote without a wait, no blocking host transfer where none is needed, collectives on the
group's device, and the defects found by reading the CUDA code (issue 31), each pinned."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zero3.engine import AgreeingGradScaler, ShardedModel, clip_grad_norm_
from lightning_zero3.engine.buffers import BufferPool, indexed
from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.materialize import parameters_on_meta
from tests.support.cuda_standin import counting, standin
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _batch(rank: int, world_size: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = mlp_batch(step)
    return local_slice(x, rank, world_size), local_slice(y, rank, world_size)


def _autocast(precision: str | None) -> Any:
    return torch.autocast("cpu", dtype=AUTOCAST.get(precision or "", torch.float32), enabled=precision is not None)


def _step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor, precision: str | None,
          scaler: Any = None) -> None:  # fmt: skip
    with _autocast(precision):
        loss = F.mse_loss(model(x).float(), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad()


def _train_evaluate_save_load(rank: int, world_size: int, precision: str | None, options: dict) -> dict:
    torch.manual_seed(0)
    x, y = _batch(rank, world_size)
    with standin() as mode:
        model = MLP(depth=3)
        param_dtype = AUTOCAST.get(precision or "")
        sharded = ShardedModel(model, reductions_in_flight=2, param_dtype=param_dtype, **options)  # CUDA's default
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = AgreeingGradScaler(sharded, device="cpu") if precision == "16-mixed" else None
        for _ in range(3):
            _step(model, optimizer, x, y, precision, scaler)
            sharded.end_step()
        with torch.no_grad(), _autocast(precision):
            model(x)
        state = sharded.full_state_dict(to_rank=None)
        sharded.load_full_state_dict(state)
        with torch.no_grad(), _autocast(precision):
            model(x)
        sharded._checks.check()
    return {
        "races": mode.races[:5],
        "streams": sorted({s.name for s in mode.api.streams}),
        "waits": sum(kind.startswith("wait") for kind, _, _ in mode.api.edges),
        "devices": sorted({d for _, devices in mode.collectives for d in devices}),
    }


SETTINGS = {  # (ranks, precision, options)
    "defaults": (2, None, {}),
    "shard_size": (2, None, {"shard_size": 1}),
    "reshard_after_forward False": (2, None, {"reshard_after_forward": False}),
    "reshard_after_forward 2": (4, None, {"reshard_after_forward": 2}),  # slices need G < N
    "offload host": (2, None, {"offload": "host"}),
    "bf16-mixed": (2, "bf16-mixed", {}),
    "16-mixed": (2, "16-mixed", {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_training_evaluation_save_and_load_order_every_cross_stream_read(setting: str) -> None:
    """A race here is a wrong result or a crash on a GPU, seen by no CPU test before."""
    ranks, precision, options = SETTINGS[setting]
    for result in run_ranks(_train_evaluate_save_load, ranks, precision, options):
        assert result["races"] == [], result
        assert {"copy_in", "gather", "reduce"} <= set(result["streams"]) and result["waits"] > 0, result
        assert result["devices"] == ["cpu"], result  # every collective on the group's device


def _first_step_across_shard_groups(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    x, y = _batch(rank, world_size)
    with standin() as mode:
        model = MLP(depth=3)
        ShardedModel(model, shard_size=1, reductions_in_flight=2)
        F.mse_loss(model(x), y).backward()  # the first step checks every tag at once
    return mode.races


def test_reduce_tags_made_on_the_replicate_stream_are_read_after_its_event() -> None:
    """Before: `check()` read the tag the All-Reduce across shard groups brought, made on the
    "replicate" stream, from the compute stream without a wait (a false or missed mismatch)."""
    for races in run_ranks(_first_step_across_shard_groups, 2):
        assert races == [], races


# ---- host transfers per steady step, against DDP ---------------------------------------------
def _transfers_per_step(rank: int, world_size: int, engine: str) -> list[dict]:
    torch.manual_seed(0)
    model = MLP(depth=6)  # 7 units: the root and 6 blocks
    if engine == "zero3":
        ShardedModel(model)
        wrapped: nn.Module = model
    else:
        wrapped = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps = []
    for step in range(7):
        x, y = _batch(rank, world_size, step)
        with counting() as mode:
            _step(wrapped, optimizer, x, y, None)
        steps.append(dict(mode.counts))
    return steps[2:]  # steps 3-7: the first records the order and checks at once


@pytest.mark.slow
def test_a_steady_training_step_writes_no_host_value_and_reads_about_as_often_as_ddp() -> None:
    """Before: each unit's Reduce-Scatter check column was stamped with `column[i] = code`, a
    Python int copied from pageable host memory (7 per step here; DDP 0)."""
    zero3, ddp = run_ranks(_transfers_per_step, 2, "zero3"), run_ranks(_transfers_per_step, 2, "ddp")
    for mine, theirs in zip(zero3, ddp):
        for ours, plain in zip(mine, theirs):
            assert ours.get("host_writes", 0) == 0, mine
            assert abs(ours.get("host_reads", 0) - plain.get("host_reads", 0)) <= 1, (mine, theirs)


# ---- fp16 with offload and a fused optimizer ---------------------------------------------------
def _overflow_with_offload(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = MLP(depth=2)
    sharded = ShardedModel(model, offload="host", param_dtype=torch.float16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = AgreeingGradScaler(sharded, device="cpu")
    given: list[Any] = []
    real_step = optimizer.step

    def spied_step(*args: Any, **kwargs: Any) -> Any:
        given.append(getattr(optimizer, "found_inf", None))
        return real_step(*args, **kwargs)

    optimizer.step = spied_step  # type: ignore[method-assign]
    x, y = _batch(rank, world_size)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scale = scaler.get_scale()
    scaler.scale(loss * (float("inf") if rank == 0 else 1.0)).backward()  # one rank overflows
    scaler.step(optimizer)
    scaler.update()
    return {
        "flags": [None if f is None else f.device.type for f in given],
        "params": sorted({p.device.type for p in model.parameters()}),
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
        "scale": (scale, scaler.get_scale()),
    }


def test_an_overflowed_fp16_step_with_offload_and_a_fused_optimizer_is_skipped_by_the_host() -> None:
    """A fused optimizer given GradScaler's flag on the GPU copies it into pinned host memory
    without waiting and reads it at once: the host must decide (optim.py, Note: fused steps on
    the host). On CPU the devices coincide, so the test checks that no flag is handed over: before,
    the flag of the loss's device was."""
    for result in run_ranks(_overflow_with_offload, 2):
        assert result["params"] == ["cpu"], result
        assert result["flags"] in ([], [None]), result  # skipped by the host, or stepped with no device flag
        assert result["unchanged"] and result["scale"][1] == result["scale"][0] / 2, result


# ---- clipping with offload -----------------------------------------------------------------------
def _moves_to_clip(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = MLP(depth=3)
    sharded = ShardedModel(model, offload="host")
    x, y = _batch(rank, world_size)
    F.mse_loss(model(x), y).backward()
    with counting() as mode:
        clip_grad_norm_(sharded, list(model.parameters()), 0.01)
    return {"moves": mode.counts["moves"], "params": len(list(model.parameters()))}


def test_clipping_host_gradients_moves_their_norms_to_the_device_in_one_copy() -> None:
    """The norms go to the device in one copy and torch's `clip_grads_with_norm_` brings the
    coefficient back in one. Before: one copy per parameter (22 here) on every clipped step."""
    for result in run_ranks(_moves_to_clip, 2):
        assert result["params"] == 22 and result["moves"] <= 2, result


# ---- building on meta --------------------------------------------------------------------------
def test_parameters_on_meta_for_a_gpu_touches_no_gpu() -> None:
    """Before: modules were built under `torch.device("cuda", 0)` (a CUDA context in the launching
    process, every parameter allocated there once): on this CPU build, "Torch not compiled with CUDA"."""
    with parameters_on_meta(torch.device("cuda", 0)):
        model = MLP(depth=2)
    assert all(p.is_meta for p in model.parameters())


# ---- timing events -------------------------------------------------------------------------------
def _waits_after_evaluation(rank: int, world_size: int, passes: int) -> dict:
    torch.manual_seed(0)
    x, _ = _batch(rank, world_size)
    with standin():
        model = MLP(depth=3)
        sharded = ShardedModel(model, reductions_in_flight=2)
        with torch.no_grad():
            for _ in range(passes):
                model(x)  # no optimizer step: nothing calls end_step
    return {"waits": len(sharded.stats.waits), "units": len(sharded._units)}


@pytest.mark.slow
def test_evaluation_loops_keep_only_the_timing_events_in_flight() -> None:
    """Before: two events per gather, kept until an `end_step` that evaluation never calls."""
    for result in run_ranks(_waits_after_evaluation, 2, 20):
        assert result["waits"] <= result["units"], result


# ---- devices named without an index -----------------------------------------------------------
class _OnGpu0(torch.Tensor):
    """A host tensor that says it is on cuda:0, as every CUDA tensor's device has an index."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def test_a_device_named_without_an_index_reuses_the_same_buffers_and_streams() -> None:
    """Before: the pool took under "cuda" and gave back under "cuda:0": nothing was reused and
    memory grew every step (a plain ShardedModel with device="cuda")."""
    with standin(as_cuda=True):
        assert indexed("cuda") == torch.device("cuda", 0)
        pool = BufferPool()
        buffer = torch.empty(8).as_subclass(_OnGpu0)
        pool.give("gather", buffer)
        assert pool.take("gather", 8, torch.float32, torch.device("cuda")) is buffer
        comm = Comm(None)
        assert comm.streams(torch.device("cuda")) is comm.streams(torch.device("cuda", 0))
