"""Quantized collectives (`quantize_weights`, `quantize_gradients`; engine/quantize.py): the block
codec moves no element by more than half its block's scale; trained on real ranks the model stays
close to one process's exact run; the master shards and everything exact (full state dicts) are
never quantized; and the bytes the collectives count are the packed rows, what the formula
(accounting.py) predicts: at most 0.27x of fp32's for weights, 0.3x for int8 gradients."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from lightning_zero3.engine import ShardedModel, ShardingConfig
from lightning_zero3.engine.config import DEFAULT_BLOCK
from lightning_zero3.engine.quantize import RowCodec, packed_row_bytes
from tests.support import models
from tests.support.parity import lm_loss
from tests.support.ranks import run_ranks


def _round_trip(x: torch.Tensor, data: int, *, block: int, bits: int) -> tuple[torch.Tensor, RowCodec]:
    codec = RowCodec(width=x.shape[1], data=data, itemsize=x.element_size(), block=block, bits=bits)
    packed = torch.zeros(x.shape[0], codec.row_bytes, dtype=torch.uint8)
    codec.quantize(x, packed)
    out = torch.full_like(x, 7.0)
    codec.dequantize(packed, out)
    return out, codec


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("data", "block"), [(1000, 64), (4096, 256), (33, 16)])  # last block short, or not
def test_no_element_moves_by_more_than_half_its_blocks_scale(bits: int, data: int, block: int) -> None:
    g = torch.Generator().manual_seed(bits + data)
    x = torch.randn(3, data + 5, generator=g) * torch.logspace(-3, 2, data + 5)  # blocks of very different scales
    out, codec = _round_trip(x, data, block=block, bits=bits)
    padded = torch.nn.functional.pad(x[:, :data], (0, codec.blocks * block - data)).view(3, codec.blocks, block)
    half_scale = (padded.abs().amax(dim=2, keepdim=True) / codec.qmax / 2).expand(-1, -1, block).reshape(3, -1)
    error = (out[:, :data] - x[:, :data]).abs()
    assert bool((error <= half_scale[:, :data] * (1 + 1e-6)).all())
    assert bool((error > 0).any()), "quantized, not copied"
    assert torch.equal(out[:, data:], x[:, data:]), "the tail (check slot, padding) travels bit for bit"


def test_a_zero_block_stays_zero_and_a_non_finite_block_stays_non_finite() -> None:
    x = torch.zeros(1, 64)
    x[0, 40] = float("inf")
    out, _ = _round_trip(x, 64, block=32, bits=8)
    assert torch.equal(out[0, :32], torch.zeros(32))
    assert not bool(out[0, 32:].isfinite().any()), "an overflow must reach the step that checks for it"


@pytest.mark.parametrize(("bits", "bound"), [(8, 0.27), (4, 0.14)])
def test_a_packed_row_is_at_most_the_bound_of_fp32s_bytes(bits: int, bound: float) -> None:
    for data in (4096, 100_000):
        assert packed_row_bytes(data, 16, block=DEFAULT_BLOCK, bits=bits) <= bound * (4 * data + 16)


@pytest.mark.parametrize(
    ("option", "value"),
    [("quantize_weights", "int8"), ("quantize_gradients", "int2"), ("quantize_gradients", 8), ("quantize_block", 100)],
)
def test_a_bad_quantization_option_names_itself(option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"ShardingConfig\({option}=\.\.\.\) must be"):
        ShardingConfig(**{option: value})


def test_quantized_weights_with_shard_groups_of_one_rank_are_refused_and_gradients_allowed() -> None:
    """Groups of one gather no weights; their gradients cross between groups, quantized."""
    with pytest.raises(ValueError, match=r"quantize_weights=True with shard_size=1"):
        ShardingConfig(shard_size=1, quantize_weights=True)
    assert ShardingConfig(shard_size=1, quantize_gradients=True).quantization.gradients == 8


QUANTIZED = {"quantize_weights": True, "quantize_gradients": True, "persistence_threshold": 16}


def _sent_as_is(units: list, record: Any) -> dict[str, int]:
    """The bytes the step's collectives would have counted unquantized (test_engine_record.py)."""
    gather = sum(units[u].world_size * units[u].row_numel() * units[u].param_dtype.itemsize * k
                 for u, k in record.gathered.items())  # fmt: skip
    reduce = sum(units[u].world_size * units[u].reduce_row_numel * units[u].reduce_dtype.itemsize * k
                 for u, k in record.reduced.items())  # fmt: skip
    groups = units[0].replicate.world_size if units[0].replicate is not None else 0  # an All-Gather of the rows
    return {"all_gather": gather, "reduce_scatter": reduce, "across": groups * reduce // units[0].world_size}


def _quantized_training(rank: int, world_size: int, options: dict[str, Any], micro_batches: int) -> dict[str, Any]:
    """Five AdamW steps of TinyGPT, quantized on the ranks and exact in one process on the whole
    batch (autocast to bf16 in both with param_dtype="bf16"; with 2 micro-batches the first
    under no_sync), recording losses, bytes, and the compute gather against the exact one."""
    torch.manual_seed(0)
    reference = models.TinyGPT()
    torch.manual_seed(0)
    model = models.TinyGPT()
    sharded = ShardedModel(model, **options)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.get("param_dtype") == "bf16")
    steps, worst_loss = [], 0.0
    for step in range(5):
        for micro in range(micro_batches):
            x, y = models.gpt_batch(step * micro_batches + micro, batch=12)
            n = x.shape[0] // world_size
            with autocast:
                ref_loss = lm_loss(reference(x), y) / micro_batches
            ref_loss.backward()
            with sharded.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext(), autocast:
                loss = lm_loss(model(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n]) / micro_batches
            loss.backward()
            mean = loss.detach().float().clone()
            sharded.world_comm.all_reduce(mean, what="test loss")
            reference_loss = float(ref_loss.detach())
            worst_loss = max(worst_loss, abs(float(mean) / world_size - reference_loss) / reference_loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        sharded.stats.end_step()
        across = sharded.stats.across_groups.last_step if sharded.stats.across_groups is not None else {}
        steps.append({
            "measured": {kind: b.payload_bytes for kind, b in sharded.stats.shard_group.last_step.items()},
            "formula": sharded.stats.last_step_expected_bytes(),
            "as_is": _sent_as_is(sharded._units, sharded.stats.last_step_record),
            "across": {kind: b.payload_bytes for kind, b in across.items()},
            "across_formula": sharded.stats.last_step_expected_bytes(across_groups=True),
        })  # fmt: skip
    unit = max(sharded._units, key=lambda u: u.shard_numel)
    fulls = unit.gather()  # what forward computes with
    compute = [t.to(torch.float32, copy=True) for t in fulls]
    unit.release(fulls)
    fulls = unit.gather(dtype=unit.shard_dtype)
    exact = [t.clone() for t in fulls]
    unit.release(fulls)
    full = sharded.full_state_dict(to_rank=None)
    names = {id(p): n for n, p in model.named_parameters()}
    masters_in_full = all(
        torch.equal(full[names[id(p.param)]].view(-1)[rank * p.shard_numel :][: p.shard_numel],
                    p.param.detach()[: max(0, min(p.shard_numel, p.numel - rank * p.shard_numel))])
        for u in sharded._units for p in u.params if id(p.param) in names
    )  # fmt: skip
    # Relative to the unit's largest element: a block may span the end of one parameter's shard and the next's.
    top = max(float(e.abs().max()) for e in exact)
    deviation = max(float((c - e).abs().max()) for c, e in zip(compute, exact)) / top
    param = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())
    return {"loss": worst_loss, "param": param, "steps": steps, "masters_in_full": masters_in_full,
            "deviation": deviation, "compute": compute}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "options", "micro_batches"),
    [
        (3, QUANTIZED, 1),
        (4, {**QUANTIZED, "shard_size": 2, "param_dtype": "bf16"}, 1),
        (4, {"quantize_gradients": "int4", "shard_size": 2, "persistence_threshold": 16}, 1),
        (2, {"quantize_gradients": True, "shard_size": 1, "persistence_threshold": 16}, 1),
        (2, {**QUANTIZED, "quantize_gradients": "int4", "reshard_after_forward": False, "offload": "host"}, 2),
    ],
    ids=["int8-3-ranks", "shard_size-bf16-4-ranks", "int4-2-groups-of-2", "int8-groups-of-1",
         "int4-kept-offload-no_sync"],
)
def test_quantized_training_stays_close_to_one_process_and_counts_the_packed_bytes(world_size, options, micro_batches):
    int4 = options["quantize_gradients"] == "int4"
    results = run_ranks(_quantized_training, world_size, options, micro_batches, timeout_s=120)
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(result["compute"], results[0]["compute"])), (
            "every rank computes with the same decoded weights, its own row's too"
        )
        assert result["loss"] < 0.01, result["loss"]
        assert result["param"] < 1e-2, result["param"]  # AdamW moves an element at most ~lr (1e-3) a step
        assert result["masters_in_full"], "the full state dict holds the master shards, unquantized"
        rounding = 2**-9 if options.get("param_dtype") == "bf16" else 1e-6  # of the cast to the compute dtype
        weights_quantized, inside = options.get("quantize_weights", False), options.get("shard_size") != 1
        assert (0 < result["deviation"]) == weights_quantized, result["deviation"]
        assert result["deviation"] <= 1 / 254 + rounding, result["deviation"]  # half the largest scale, relative
        for step in result["steps"]:
            measured, formula, as_is = step["measured"], step["formula"], step["as_is"]
            assert measured["all_gather"] == formula["all_gather"], step
            assert measured["reduce_scatter"] == formula["reduce_scatter"], step
            weights = 0.27 * (2 if options.get("param_dtype") == "bf16" else 1)  # against the gather's own dtype
            assert measured["all_gather"] <= (weights if weights_quantized else 1) * as_is["all_gather"], step
            assert measured["reduce_scatter"] <= ((0.17 if int4 else 0.3) if inside else 1) * as_is["reduce_scatter"]
            across, across_formula = step["across"], step["across_formula"]
            assert set(across) == set(across_formula), step
            if "shard_size" in options:  # the gradients cross the groups quantized (all_reduce: the persistent's)
                assert across["all_gather"] == across_formula["all_gather"], step
                assert across.get("all_reduce") == across_formula.get("all_reduce"), step
                assert 0 < across["all_gather"] <= (0.17 if int4 else 0.3) * as_is["across"], step


def _packs_once_per_change(rank: int, world_size: int, micro_batches: int) -> dict[str, Any]:
    """quantize_weights on TinyGPT: the codec's packing calls and the gathers of each step of
    `micro_batches` micro-batches; then the compute gather after each kind of write to the shards,
    against a fresh packing (the kept codes forgotten) and against the gather before the write."""
    calls = [0]
    quantize = RowCodec.quantize

    def counted(codec: RowCodec, rows: torch.Tensor, packed: torch.Tensor) -> None:
        calls[0] += 1
        quantize(codec, rows, packed)

    RowCodec.quantize = counted  # type: ignore[method-assign]  # this rank's process only
    torch.manual_seed(0)
    model = models.TinyGPT()
    sharded = ShardedModel(model, quantize_weights=True, persistence_threshold=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # fused: no version counted
    steps = []
    for step in range(3):
        calls[0] = 0
        for micro in range(micro_batches):
            x, y = models.gpt_batch(step * micro_batches + micro, batch=4)
            with sharded.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext():
                lm_loss(model(x), y).backward()
            with torch.no_grad():  # a validation pass between micro-batches
                model(x)
        optimizer.step()
        optimizer.zero_grad()
        sharded.stats.end_step()
        steps.append({"packs": calls[0], "gathers": sum(sharded.stats.last_step_record.gathered.values())})
    unit = max(sharded._units, key=lambda u: u.shard_numel)

    def compute() -> list[torch.Tensor]:
        fulls = unit.gather()
        values = [t.clone() for t in fulls]
        unit.release(fulls)
        return values

    def fresh() -> list[torch.Tensor]:
        unit._packed.forget()
        return compute()

    full = sharded.full_state_dict(to_rank=None)
    shard = unit.params[0].param
    writes: dict[str, Any] = {
        "in place": lambda: shard.mul_(1.5),
        "data swapped": lambda: setattr(shard, "data", shard.data * 0.5),
        "optimizer step": lambda: (setattr(shard, "grad", torch.ones_like(shard)), optimizer.step()),
        "load_full_state_dict": lambda: sharded.load_full_state_dict({k: v * 2 for k, v in full.items()}),
    }
    seen = {}
    for name, write in writes.items():
        fresh()
        before = compute()
        with torch.no_grad():
            write()
        after = compute()
        seen[name] = {"changed": not all(torch.equal(a, b) for a, b in zip(before, after)),
                      "fresh": all(torch.equal(a, b) for a, b in zip(after, fresh()))}  # fmt: skip
    RowCodec.quantize = quantize  # type: ignore[method-assign]
    return {"steps": steps, "units": sum(1 for u in sharded._units if u.params), "seen": seen, "compute": compute()}


@pytest.mark.slow
def test_each_unit_packs_its_row_once_per_change_of_its_shards_and_never_sends_stale_codes() -> None:
    results = run_ranks(_packs_once_per_change, 2, 3, timeout_s=120)
    for result in results:
        for step in result["steps"]:  # three micro-batches, each with a validation pass
            assert step["packs"] == result["units"] < step["gathers"], step
        for name, seen in result["seen"].items():
            assert seen == {"changed": True, "fresh": True}, (name, seen)
        assert all(torch.equal(a, b) for a, b in zip(result["compute"], results[0]["compute"]))
