"""Setup of a model built with its parameters on the meta device (`configure_model`,
`trainer.init_module(empty_init=True)`) grows each rank's resident memory by its shards plus a
few transient layers, and teardown's restore adds about one unit on the shards' device, with
glibc's default allocator settings, as users run it (engine/materialize.py, Notes: shards
before full tensors; restoring unit by unit)."""

from __future__ import annotations

import functools

import pytest
from torch import nn

from benchmarks.measure import reset_peak_rss, status_bytes
from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.materialize import parameters_on_meta
from tests.support.ranks import run_ranks

MB = 2**20


def _setup_growth(rank: int, world_size: int) -> dict:
    start = reset_peak_rss()  # the peak (VmHWM) becomes the current resident set (VmRSS)
    with parameters_on_meta("cpu"):  # what the strategy's configure_model context does
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(24)])  # 384 MiB, 16 MiB per layer
    sharded = ShardedModel(model, device="cpu")
    setup_peak = status_bytes("VmHWM") - start
    is_sharded = all(p.dim() == 1 and not p.is_meta for p in model.parameters())
    start = reset_peak_rss()
    sharded.restore_module(device="meta")  # stands in for host memory while the shards are on a GPU
    return {
        "restore_peak": status_bytes("VmHWM") - start,
        "peak": setup_peak,
        "model": sum(p.numel * 4 for p in sharded.sharded_params),
        "unit": max(u.numel * 4 for u in sharded._units),
        "sharded": is_sharded,
    }


@functools.cache
def _results() -> list[dict]:
    return run_ranks(_setup_growth, 2)  # one launch for both tests


def _figures(result: dict) -> dict:
    return {k: round(v / MB, 1) for k, v in result.items() if k != "sharded"}


@pytest.mark.slow
def test_setup_from_meta_grows_by_the_shards_and_two_layers_not_the_model() -> None:
    for result in _results():
        assert result["sharded"]
        bound = result["model"] / 2 + 2 * result["unit"] + 100 * MB
        assert result["peak"] <= bound, f"{_figures(result)}, bound {bound / MB:.0f} MiB"


@pytest.mark.slow
def test_restore_after_setup_keeps_no_unit_resident_on_the_shards_device() -> None:
    for result in _results():
        assert result["restore_peak"] < 3 * result["unit"] + 8 * MB, _figures(result)
