"""After `fit` the Trainer's teardown leaves the module sharded, at rest (common/run.py, Note: run
lifecycle): no whole copy anywhere. Putting whole parameters back on the modules
(`ShardedModel.restore_module`, what a new engine does with a module left sharded or at rest)
builds the output one unit at a time on the device asked for: the shards' device holds one unit
more than before, never the whole model (engine/materialize.py, Note: restoring unit by unit). On
CPU, "meta" stands in for "host memory while the shards are on a GPU". The `fit` runs on the gloo
harness's ranks (tests/support/ranks.py), as a torchrun job: it measures each rank's memory after `fit`
returns, and Lightning's multiprocessing launcher, by design, gathers whole weights to rank 0 then
(to hand them back), which is the copy this test rules out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.measure import reset_peak_rss, status_bytes
from lightning_zero3.engine import ShardedModel
from tests.engine.test_engine_pool import live_storage_bytes
from tests.support.ranks import run_ranks

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
        "unit": max(u.numel * 4 for u in sharded._units),
        "devices": {str(t.device) for t in restored.values()},
        "shapes_whole": all(restored[k].shape == v.shape for k, v in expected.items()),
        "equal": all(torch.equal(restored[k], v) for k, v in expected.items()),
        "hooks_left": len(sharded._hooks.handles),
    }


def test_restore_to_another_device_holds_one_unit_on_the_shards_device_not_the_model() -> None:
    for result in run_ranks(_restore, 2, "meta"):
        assert result["devices"] == {"meta"}
        assert result["hooks_left"] == 0
        # one unit gathered (its gather buffer and a staging block) at a time; nothing kept here
        assert result["peak"] < 3 * result["unit"] + 8 * MB, {k: result[k] for k in ("peak", "unit", "model")}


@pytest.mark.slow
def test_restore_to_the_cpu_builds_the_whole_model_exactly_with_one_unit_of_overhead() -> None:
    for result in run_ranks(_restore, 2, "cpu"):
        assert result["devices"] == {"cpu"} and result["shapes_whole"] and result["equal"]
        assert result["peak"] < result["model"] + 2 * result["unit"] + 8 * MB, result


def _fit_and_look(rank: int, world_size: int) -> dict:
    import lightning.pytorch as pl

    from tests.support.lit import become_lightning_rank, trainer

    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    class Wide(pl.LightningModule):  # 12 linears of 4 MiB: 48 MiB of weights, one unit each
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(12)))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layers(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class AtTrainEnd(pl.Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            # Issue 36's user: whole weights at each epoch's end, measured around the call.
            pool = trainer.strategy.sharded_model()._pool
            self.around_gather = [(pool.cached_bytes, live_storage_bytes())]
            with trainer.strategy.gathered_for_inference(), torch.no_grad():
                pl_module.layers(torch.randn(2, 1024))
            self.around_gather.append((pool.cached_bytes, live_storage_bytes()))

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.rss = status_bytes("RssAnon")

    strategy, at_end, model = ZeRO3Strategy(), AtTrainEnd(), Wide()
    batches = torch.utils.data.DataLoader(torch.randn(8, 1024), batch_size=2)
    trainer(strategy, world_size, max_steps=2, callbacks=[at_end]).fit(model, batches)
    grown = status_bytes("RssAnon") - at_end.rss
    params = list(model.parameters())
    engine = strategy.sharded_model()
    return {
        "around_gather": at_end.around_gather,
        "grown": grown,
        "model": sum(p.numel * 4 for p in engine.sharded_params),
        "params_are_shards": all(p.param.numel() == p.shard_numel for p in engine.sharded_params)
        and {id(p.param) for p in engine.sharded_params} <= {id(p) for p in model.parameters()}
        and all(p.dim() == 1 for p in model.parameters()),
        # the storages the module's parameters hold: this rank's shards, and the small persistent ones whole
        "param_bytes": sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}.values()),
        "persistent_bytes": sum(p.numel() * 4 for p in engine._persistent),
        "shard_grad_bytes": sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None),
        "pool_bytes": engine._pool.cached_bytes,
        "optimizer_state": sum(len(s) for s in strategy.optimizers[0].state.values()),
    }


@pytest.fixture(scope="module")
def fit_and_look() -> list[dict]:
    return run_ranks(_fit_and_look, 2)


@pytest.mark.slow
def test_after_fit_the_module_stays_sharded_with_no_whole_copy_gradients_or_pool(fit_and_look) -> None:
    """At rest after `fit` (common/run.py, Note: run lifecycle) the module's parameters are this rank's
    shards and nothing whole was built: anonymous RSS after `fit` returns is within a quarter of
    the model of what it was at `on_train_end` (a whole copy adds the model, 48 MiB); the shards'
    gradients and the buffer pool are freed; the optimizer state stays, for a save or a next fit."""
    for result in fit_and_look:
        assert result["params_are_shards"], result
        assert result["param_bytes"] <= result["model"] // 2 + result["persistent_bytes"], result
        assert result["grown"] < result["model"] // 4, result
        assert result["shard_grad_bytes"] == 0 and result["pool_bytes"] == 0, result
        assert result["optimizer_state"] > 0


@pytest.mark.slow
def test_a_callback_gathering_for_inference_at_an_epochs_end_leaves_no_buffer_behind(fit_and_look) -> None:
    """Issue 36's repro, on live storages: after `gathered_for_inference()` in a Trainer callback
    the pool and the storages alive are what they were before it (was: 11 of the 12 blocks kept)."""
    for result in fit_and_look:
        before, after = result["around_gather"]
        assert before[0] > 0 and after == before, result
