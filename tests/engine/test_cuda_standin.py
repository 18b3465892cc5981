"""The engine's CUDA code path, run on CPU through the stand-in for CUDA's streams and ordering
rules (tests/support/cuda_standin.py; engine/buffers.py, Note: stream seam): no read on one stream of what
another wrote without a wait, no blocking host transfer where none is needed, collectives on the
group's device, and the defects found by reading the CUDA code (issue 31), each pinned."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

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
        sharded = ShardedModel(model, reductions_in_flight=2, param_dtype=param_dtype, **options)  # above CUDA's 1
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = AgreeingGradScaler(sharded, device="cpu") if precision == "16-mixed" else None
        for _ in range(3):
            _step(model, optimizer, x, y, precision, scaler)
            sharded.stats.end_step()
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


QUANTIZED = {"quantize_weights": True, "quantize_gradients": True}
SETTINGS = {  # (ranks, precision, options)
    "defaults": (2, None, {}),
    "shard_size": (2, None, {"shard_size": 1}),
    "reshard_after_forward False": (2, None, {"reshard_after_forward": False}),
    "reshard_after_forward 2": (4, None, {"reshard_after_forward": 2}),  # slices need G < N
    "offload host": (2, None, {"offload": "host"}),
    "bf16-mixed": (2, "bf16-mixed", {}),
    "16-mixed": (2, "16-mixed", {}),
    "quantized bf16-mixed": (2, "bf16-mixed", {"quantize_weights": True, "quantize_gradients": True}),
    "quantized shard_size 2": (4, None, {"shard_size": 2, "quantize_weights": True, "quantize_gradients": "int4"}),
    # an unconfirmed race report with 16-mixed + quantization (issue 37), refuted by these
    "quantized 16-mixed": (2, "16-mixed", QUANTIZED),
    "quantized 16-mixed kept offload": (2, "16-mixed", {"quantize_weights": True, "quantize_gradients": "int4",
                                                        "reshard_after_forward": False, "offload": "host"}),
    "quantized bf16-mixed shard_size 2 reshard 2": (4, "bf16-mixed", {**QUANTIZED, "shard_size": 2,
                                                                      "reshard_after_forward": 2}),
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


# ---- steady steps on the path CUDA takes, against DDP -------------------------------------------
COPIES = {"copy_", "_to_copy", "clone", "cat", "_chunk_cat", "split_with_sizes_copy", "_foreach_copy_",
          "constant_pad_nd", "stack"}  # fmt: skip


class _Linears(nn.Module):
    """A block of `k` Linear layers (odd sizes: padded at 2 ranks)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(13, 13) for _ in range(k)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


class _Stack(nn.Module):
    """The root (input and head) and 5 blocks of `k` Linear layers: 6 units."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(7, 13), nn.Linear(13, 5)
        self.blocks = nn.ModuleList(_Linears(k) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _per_tensor_form(name: str, args: Any, kwargs: dict) -> str | None:
    """Why CUDA would run this copy as a kernel per tensor (unit.py, Note: one kernel per copy), or None."""
    if name == "split_with_sizes_copy":
        source, outs = args[0], kwargs["out"]
        if not source.is_contiguous() or any(not o.is_contiguous() or o.dtype != source.dtype for o in outs):
            return f"split_with_sizes_copy of a {'' if source.is_contiguous() else 'non-'}dense input"
    elif name in ("cat", "_chunk_cat"):
        tensors, out = args[0], kwargs.get("out")
        dtypes = {t.dtype for t in tensors}
        if any(not t.is_contiguous() for t in tensors) or (out is not None and not out.is_contiguous()):
            return f"{name} of non-contiguous tensors"
        if out is not None and dtypes != {out.dtype} and (name == "cat" or dtypes != {torch.bfloat16}):
            return f"{name} casting {sorted(map(str, dtypes))} to {out.dtype}"
    elif name == "_foreach_copy_":
        dsts, srcs = args[0], args[1]
        if len({d.dtype for d in dsts}) > 1 or len({t.dtype for t in srcs}) > 1:
            return "_foreach_copy_ of mixed dtypes"
        if any(d.shape != t.shape or d.stride() != t.stride() for d, t in zip(dsts, srcs)):
            return "_foreach_copy_ of different layouts"
    return None


class _Ops(TorchDispatchMode):
    """Copy ops counted, the forms CUDA runs per tensor, and the streams gradients are averaged on."""

    def __init__(self, api: Any) -> None:
        super().__init__()
        self.api = api
        self.copies = 0
        self.per_tensor: list[str] = []
        self.averaged_on: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        self.copies += name in COPIES
        why = _per_tensor_form(name, args, kwargs)
        if why is not None:
            self.per_tensor.append(why)
        if name == "div" and "out" in kwargs:  # the engine's average (reduce.py); the model's divide in place
            self.averaged_on.add(f"{self.api.current.name}: {kwargs['out'].dtype}")
        return func(*args, **kwargs)


def _steady_steps(rank: int, world_size: int, engine: str, k: int, options: dict) -> list[dict]:
    """Steps 3-7 of training `_Stack(k)` with AdamW (the first records the order and checks at
    once): zero3 through the stand-in (the path CUDA takes), DDP counted alike."""
    torch.manual_seed(0)
    options = dict(options)
    moved = options.pop("moved", False)
    with standin() if engine == "zero3" else counting() as mode:
        model = _Stack(k)
        if engine == "zero3":
            ShardedModel(model, wrap_policy={_Linears}, **options)
            wrapped: nn.Module = model
            for param in model.parameters() if moved else ():  # each shard off the unit's buffer
                param.data = param.data.clone()
        else:
            wrapped = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        steps = []
        for step in range(7):
            x, y = _batch(rank, world_size, step)
            before = dict(mode.counts)
            with _Ops(mode.api) as ops:
                _step(wrapped, optimizer, x, y, "bf16-mixed" if options.get("param_dtype") else None)
            counts = {key: mode.counts[key] - before.get(key, 0) for key in ("host_reads", "host_writes")}
            steps.append({**counts, "copies": ops.copies, "per_tensor": ops.per_tensor[:3],
                          "averaged_on": sorted(ops.averaged_on), "races": mode.races[:3]})  # fmt: skip
    return steps[2:]


@pytest.mark.slow
def test_a_steady_step_reads_and_writes_the_host_as_often_as_ddp_on_the_cuda_path() -> None:
    """Before: the rank checks read the step's tags with one `.tolist()`, a sync DDP does not
    have (checks.py, Note: deferred tag checks); earlier, each unit's check column was stamped
    with `column[i] = code`, a Python int copied from pageable host memory. What both count is
    AdamW's (its CPU step counters)."""
    zero3, ddp = run_ranks(_steady_steps, 2, "zero3", 2, {}), run_ranks(_steady_steps, 2, "ddp", 2, {})
    for mine, theirs in zip(zero3, ddp):
        for ours, plain in zip(mine, theirs):
            assert ours["races"] == [], mine
            for count in ("host_reads", "host_writes"):
                assert ours[count] == plain[count], (count, mine, theirs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{}, {"param_dtype": torch.bfloat16}, {"param_dtype": torch.bfloat16, "moved": True},
     {"reshard_after_forward": False}],  # fmt: skip
    ids=["fp32", "bf16", "bf16 shards moved", "kept"],
)
def test_every_copy_of_a_steady_step_runs_as_one_kernel_on_cuda_whatever_the_layers_per_block(options) -> None:
    """Before: the copy-out split a non-dense column slice of the gathered rows, the copy-in cast
    inside a `cat` (bf16; now one `copy_` from the shards' buffer, or a `_foreach_copy_` where
    they left it), and the Reduce-Scatter copy-in padded each odd gradient apart and cast inside
    a `cat`: a kernel per parameter on CUDA. The copies per step stay the same for 2
    and 6 Linear layers per block (6 units)."""
    two, six = (run_ranks(_steady_steps, 2, "zero3", k, options) for k in (2, 6))
    for few, many in zip(two, six):
        for a, b in zip(few, many):
            assert a["per_tensor"] == [] and b["per_tensor"] == [], (a, b)
            assert a["copies"] == b["copies"], (few, many)


@pytest.mark.slow
def test_gradients_are_averaged_and_cast_on_the_communication_stream() -> None:
    """Before: the division by N and the cast to the shards' dtype ran on the compute stream,
    after it waited for each Reduce-Scatter (FSDP2 runs both on the Reduce-Scatter stream)."""
    for steps in run_ranks(_steady_steps, 2, "zero3", 2, {"reduce_dtype": torch.float64}):
        assert all(step["averaged_on"] == ["reduce: torch.float32"] for step in steps), steps
    for steps in run_ranks(_steady_steps, 2, "zero3", 2, {"shard_size": 1}):
        assert all(step["averaged_on"] == ["replicate: torch.float32"] for step in steps), steps


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
    return {"waits": len(sharded.stats.shard_group.waits), "units": len(sharded._units)}


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


# ---- whole weights to the host ------------------------------------------------------------------
def _full_state_dict_copies(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    expected = MLP(depth=3).state_dict()
    with standin() as mode:
        torch.manual_seed(0)
        model = MLP(depth=3)
        sharded = ShardedModel(model)
        sharded.full_state_dict(to_rank=None)  # the rank checks make their stamps once
        copies, waits = Counter(mode.counts), Counter(mode.api.host_waits)
        state = sharded.full_state_dict(to_rank=None)
        copies, waits = mode.counts - copies, mode.api.host_waits - waits
    return {
        "units": len(sharded._units),
        "params": len(sharded.sharded_params),
        "copies": dict(copies),
        "waits": dict(waits),
        "equal": all(torch.equal(state[k], v) for k, v in expected.items()),
        "own_storages": len({t.untyped_storage().data_ptr() for t in state.values()}) == len(state),
    }


def test_a_full_state_dict_copies_each_unit_to_the_host_in_one_non_blocking_copy_and_waits_once() -> None:
    """Before: one blocking device-to-host copy per parameter, the host waiting at each, and
    every shard moved to the host once more, then dropped (engine/unit.py, Note: copies to the host)."""
    for result in run_ranks(_full_state_dict_copies, 2):
        units, params = result["units"], result["params"]
        assert params > units and result["equal"] and result["own_storages"], result
        assert result["copies"]["non_blocking_copies"] == units, result
        assert result["waits"] == {"event.synchronize": units}, result
        assert "moves" not in result["copies"], result  # the model has no buffer or whole parameter
