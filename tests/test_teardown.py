"""Putting whole parameters back on the modules (`ShardedModel.restore_module`, what the strategy
does at teardown) builds the output one unit at a time on the device asked for: the shards'
device holds one unit more than before, never the whole model (engine/materialize.py, Note:
restoring unit by unit). On CPU, "meta" stands in for "host memory while the shards are on a GPU"."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.measure import reset_peak_rss, status_bytes
from lightning_zero3.engine import ShardedModel
from tests.ranks import run_ranks

MB = 2**20


class _Wide(nn.Module):
    """8 blocks of two 1024x1024 linears: 67 MB in fp32, 4.2 MB per linear (one unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)) for _ in range(8))


def _restore(rank: int, world_size: int, device: str) -> dict:
    # glibc's default allocator settings, as users run (no mallopt).
    with torch.device("meta"):
        model = _Wide()
    sharded = ShardedModel(model, device="cpu")
    expected = sharded.full_state_dict(to_rank=None) if device == "cpu" else {}
    start = reset_peak_rss()
    sharded.restore_module(device=device)
    peak = status_bytes("VmHWM") - start
    restored = model.state_dict()
    return {
        "peak": peak,
        "model": sum(p.numel * 4 for p in sharded.sharded_params),
        "unit": max(u.numel * 4 for u in sharded.units),
        "devices": {str(t.device) for t in restored.values()},
        "shapes_whole": all(restored[k].shape == v.shape for k, v in expected.items()),
        "equal": all(torch.equal(restored[k], v) for k, v in expected.items()),
        "hooks_left": len(sharded.hooks.handles),
    }


def test_restore_to_another_device_holds_one_unit_on_the_shards_device_not_the_model() -> None:
    for result in run_ranks(_restore, 2, "meta"):
        assert result["devices"] == {"meta"}
        assert result["hooks_left"] == 0
        # one unit gathered (its gather buffer and a staging block) at a time; nothing kept here
        assert result["peak"] < 3 * result["unit"] + 8 * MB, {k: result[k] for k in ("peak", "unit", "model")}


def test_restore_to_the_cpu_builds_the_whole_model_exactly_with_one_unit_of_overhead() -> None:
    for result in run_ranks(_restore, 2, "cpu"):
        assert result["devices"] == {"cpu"} and result["shapes_whole"] and result["equal"]
        assert result["peak"] < result["model"] + 2 * result["unit"] + 8 * MB, result


def _fit_and_look(rank: int, world_size: int) -> dict:
    from tests.lit import LitMLP, become_lightning_rank, loader, trainer

    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    strategy = ZeRO3Strategy()
    trainer(strategy, world_size, max_steps=2).fit(LitMLP(), loader(world_size))
    engine = strategy.sharded_model
    return {
        "shard_grad_bytes": sum(
            p.param.grad.untyped_storage().nbytes() for p in engine.sharded_params if p.param.grad is not None
        ),
        "pool_bytes": engine.pool.cached_bytes,
        "optimizer_state": sum(len(s) for s in strategy.optimizers[0].state.values()),
    }


def test_teardown_after_fit_frees_the_shards_gradients_and_the_buffer_pool() -> None:
    """After `fit` the module holds new whole parameters: nothing needs the shards' gradients or
    the buffers kept for a next step (core.py, Note: run lifecycle); the optimizer state stays."""
    for result in run_ranks(_fit_and_look, 2):
        assert result["shard_grad_bytes"] == 0 and result["pool_bytes"] == 0, result
        assert result["optimizer_state"] > 0  # kept for a save after fit
