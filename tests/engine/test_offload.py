"""`offload="host"` (engine/offload.py): shards, gradients and optimizer state in host memory,
a device copy in the compute dtype for gathers. On CPU the device copy is still a tensor of its
own, so exactness and what lives where are tested here: N ranks against one process (and bit
for bit against the same run without offload), Trainer and Fabric end to end, no host read on
the hot path, a sharded checkpoint resumed at another world size."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, ShardingConfig, clip_grad_norm_
from tests.support import models
from tests.support.adapted import HandsBack, launched
from tests.support.fabric_helpers import adamw as fabric_adamw
from tests.support.fabric_helpers import every_rank, full_state, launch, max_difference, reference, train_step
from tests.support.host_reads import counting_host_reads
from tests.support.lit import LitMLP, loader, reference_fit, trainer, whole_state
from tests.support.parity import Recipe, adamw, local_slice, run_parity
from tests.support.ranks import run_ranks

TOL = 1e-5
HOST = {"offload": "host"}


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _train(rank: int, world_size: int, options: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """AdamW with global-norm clipping on an MLP whose middle block is frozen; what each step
    left where, and the final whole parameters."""
    torch.manual_seed(0)
    model = models.mlp_frozen_block()
    sharded = ShardedModel(model, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    uploads = []
    for step in range(steps):
        x, y = models.mlp_batch(step)
        before = sharded._offload.uploads if sharded._offload else 0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled="param_dtype" in options):
            out = model(local_slice(x, rank, world_size)).float()
        F.mse_loss(out, local_slice(y, rank, world_size)).backward()
        uploads.append((sharded._offload.uploads if sharded._offload else 0) - before)
        clip_grad_norm_(sharded, model.parameters(), 0.05)
        grads = [p.param.grad for p in sharded.sharded_params if p.param.grad is not None]
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)  # both: `.grad` replaced, and added into
    shards = [p.param for p in sharded.sharded_params]
    copies = list(sharded._offload._copies.values()) if sharded._offload else []
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    disk = sharded._disk
    maps = [line for line in open("/proc/self/maps") if disk and disk.directory in line]
    return {
        "full": sharded.full_state_dict(to_rank=None),
        "uploads": uploads,
        "units": sum(1 for u in sharded._units if u.params),
        "copy_dtypes": {c.dtype for c in copies},
        "copies_apart": not (_storages(copies) & _storages(shards + state)),
        "state_next_to_shards": all(v.device == shards[0].device for v in state),
        "device_bytes": sharded._offload.device_bytes() if sharded._offload else 0,
        "shard_numel": sum(u.shard_numel for u in sharded._units),
        # Offloaded: each gradient a host tensor of its own; else views of one reduced buffer per unit.
        "grad_storages": (len(_storages(grads)), len(grads)),
        "on_disk": [disk.on_disk(v) for v in state] if disk else [],
        "files": (disk.files, len(os.listdir(disk.directory)), len(maps), all("(deleted)" in m for m in maps))
        if disk
        else None,
    }


def _side_by_side(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out = {}
    for name, options in {"fp32": {}, "bf16": {"param_dtype": "bf16"}}.items():
        out[name] = {"plain": _train(rank, world_size, options), "host": _train(rank, world_size, {**options, **HOST})}
    out["disk"] = _train(rank, world_size, {**HOST, "offload_dir": directory})
    recipe = Recipe(model=models.mlp_frozen_input, batch=models.mlp_batch, optimizer=adamw, clip_norm=0.05,
                    steps=3, accumulate=2, sharded_kwargs=HOST)  # fmt: skip
    out["parity"] = run_parity(rank, world_size, recipe)
    return out


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_side_by_side, 2, str(tmp_path_factory.mktemp("offload_dir")))


@pytest.mark.slow
def test_host_offload_matches_one_process_with_clipping_accumulation_and_frozen_layers(side_by_side) -> None:
    for result in side_by_side:
        worst = result["parity"]
        assert max(worst[k] for k in ("param", "grad", "loss", "norm")) < TOL, worst
        assert worst["min_norm"] > 0.05 and worst["moved"] > 100 * TOL, worst  # it clipped, it trained


@pytest.mark.slow
@pytest.mark.parametrize("gathers", ["fp32", "bf16"])
def test_host_offload_changes_no_bit_of_training(side_by_side, gathers: str) -> None:
    for result in side_by_side:
        plain, host = result[gathers]["plain"], result[gathers]["host"]
        assert max_difference(plain["full"], host["full"]) == 0.0


@pytest.mark.slow
def test_the_device_keeps_one_copy_of_the_shards_in_the_compute_dtype_refreshed_once_a_pass(side_by_side) -> None:
    for result in side_by_side:
        for gathers, dtype, size in (("fp32", torch.float32, 4), ("bf16", torch.bfloat16, 2)):
            host = result[gathers]["host"]
            assert host["copy_dtypes"] == {dtype}
            assert host["device_bytes"] == host["shard_numel"] * size
            assert host["copies_apart"] and host["state_next_to_shards"]
            assert host["uploads"] == [host["units"]] * 3  # once per unit per pass, not per gather
            assert host["grad_storages"][0] == host["grad_storages"][1]
            plain = result[gathers]["plain"]
            assert plain["grad_storages"][0] < plain["grad_storages"][1] and plain["device_bytes"] == 0


@pytest.mark.slow
def test_optimizer_state_on_disk_changes_no_bit_and_lives_on_unlinked_file_maps(side_by_side) -> None:
    for result in side_by_side:
        disk, host = result["disk"], result["fp32"]["host"]
        assert max_difference(disk["full"], host["full"]) == 0.0
        assert disk["on_disk"] and all(disk["on_disk"])  # Adam's moments, every shard's
        # One file (the first step made all state), gone from the directory, mapped (deleted).
        assert disk["files"] == (1, 0, 1, True), disk["files"]


def _load_between_passes(rank: int, world_size: int) -> float:
    """A write that bumps no version (a full load writes `.data`) reaches the next forward."""
    torch.manual_seed(0)
    model = models.MLP()
    sharded = ShardedModel(model, **HOST)
    x, _ = models.mlp_batch(0)
    model(x)  # the device copies are now current
    torch.manual_seed(1)
    other = models.MLP()
    sharded.load_full_state_dict(other.state_dict())
    with torch.no_grad():
        return float((model(x) - other(x)).abs().max())


def test_a_load_between_passes_reaches_the_next_forward() -> None:
    assert max(run_ranks(_load_between_passes, 2)) < TOL


class _StepInsideForward(torch.nn.Module):
    """Lightning's manual optimization: `training_step` runs inside the root's forward, and may
    step the optimizer and call the model again within it (one pass, no new `begin_pass`)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = models.MLP()

    def forward(self, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        F.mse_loss(self.net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        return self.net(x)


def _step_inside_forward(rank: int, world_size: int) -> float:
    torch.manual_seed(0)
    reference = _StepInsideForward()
    torch.manual_seed(0)
    model = _StepInsideForward()
    ShardedModel(model, **HOST)
    x, y = models.mlp_batch(0)
    expected = reference(x, y, torch.optim.SGD(reference.parameters(), lr=0.5))
    out = model(
        local_slice(x, rank, world_size), local_slice(y, rank, world_size), torch.optim.SGD(model.parameters(), lr=0.5)
    )
    return float((out - local_slice(expected, rank, world_size)).abs().max())


def test_a_step_inside_a_pass_reaches_the_gathers_after_it() -> None:
    assert max(run_ranks(_step_inside_forward, 2)) < TOL


def _host_reads(rank: int, world_size: int) -> list[int]:
    torch.manual_seed(0)
    model = models.MLP(depth=3)
    ShardedModel(model, **HOST)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    x, y = models.mlp_batch(0)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    counts = []
    for _ in range(3):
        with counting_host_reads() as reads:
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        counts.append(reads.count)
    return counts


def test_offloaded_training_reads_device_memory_on_the_host_at_most_once_a_step() -> None:
    for counts in run_ranks(_host_reads, 2):
        assert all(count <= 1 for count in counts[1:]), counts


def test_bad_offload_options_name_the_option_and_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match=r'offload=\.\.\.\) must be None .* or "host"'):
        ShardingConfig(offload="disk")
    with pytest.raises(ValueError, match=r'offload_dir=\.\.\.\) must be None unless offload="host"'):
        ShardingConfig(offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"offload_dir=\.\.\.\) must be the path \(str\) of an existing directory"):
        ShardingConfig(offload="host", offload_dir=str(tmp_path / "missing"))


# ---- Lightning end to end ------------------------------------------------------------------
class _LitOffloaded(LitMLP):
    """Keeps, at the end of training, the engine's uploads and which optimizer states live on disk."""

    def on_train_end(self) -> None:
        engine = self.trainer.strategy.sharded_model()
        state = [v for s in self.trainer.optimizers[0].state.values() for v in s.values() if v.dim() > 0]
        self.seen = [(engine._offload.uploads, [engine._disk.on_disk(v) for v in state])]


class _AfterFit(pl.Callback):
    """After the strategy's teardown: the bytes of the shards' device copies, the whole weights."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.after_fit = trainer.strategy.run.engine._offload.device_bytes()
        pl_module.whole = whole_state(pl_module)


@pytest.mark.slow
def test_trainer_fit_with_host_and_disk_offload_matches_one_process(tmp_path) -> None:
    torch.manual_seed(0)
    model = _LitOffloaded()
    hands_back = HandsBack(
        state="lightning_module.whole", seen="lightning_module.seen", after_fit="lightning_module.after_fit"
    )
    options = {"max_epochs": 1, "gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    strategy = launched("zero3", offload="host", offload_dir=str(tmp_path))
    fit = trainer(strategy, 2, callbacks=[_AfterFit(), hands_back], **options)
    fit.fit(model, loader(2))
    torch.manual_seed(0)
    reference = LitMLP()
    reference_fit(reference, epochs=1, clip_norm=0.05)
    results = fit.callback_metrics
    for state, seen, after_fit in zip(results["state"], results["seen"], results["after_fit"], strict=True):
        assert max_difference(state, reference.state_dict()) < TOL
        [(uploads, on_disk)] = seen  # the strategy passed the options on
        assert uploads > 0 and on_disk and all(on_disk)
        assert after_fit == 0, "teardown must free the device copies of the shards"
    assert os.listdir(tmp_path) == []


def _fabric_save(f: Any, directory: str) -> None:
    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    model = models.MLP()
    model, optimizer = f.setup(model, fabric_adamw(model))
    for step in range(2):
        train_step(f, model, optimizer, step, rank, world_size, 0.05)
    f.save(f"{directory}/sharded", {"model": model, "optimizer": optimizer})


def _fabric_resume(f: Any, directory: str) -> list[dict[str, Any]]:
    rank, world_size = f.global_rank, f.world_size
    model = f.setup_module(models.MLP())
    optimizer = f.setup_optimizers(fabric_adamw(model))
    f.load(f"{directory}/sharded", {"model": model, "optimizer": optimizer})
    loss, norm = train_step(f, model, optimizer, 2, rank, world_size, 0.05)
    engine = f.strategy.sharded_model(model)
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    on_disk = [engine._disk.on_disk(v) for v in state]
    return every_rank({
        "loss": loss,
        "norm": norm,
        "state": full_state(f, model),
        "uploads": engine._offload.uploads,
        "on_disk": on_disk,
    })  # fmt: skip


@pytest.mark.slow
def test_fabric_with_host_and_disk_offload_resumes_a_sharded_checkpoint_at_another_world_size(tmp_path) -> None:
    launch(_fabric_save, str(tmp_path), offload="host")
    os.makedirs(tmp_path / "states")
    results = launch(_fabric_resume, str(tmp_path), devices=3, offload="host", offload_dir=str(tmp_path / "states"))
    model, expected = reference(3, clip=0.05)
    for result in results:
        assert abs(result["loss"] - expected[2][0]) < TOL and abs(result["norm"] - expected[2][1]) < TOL
        assert max_difference(result["state"], model.state_dict()) < TOL and result["uploads"] > 0
        assert result["on_disk"] and all(result["on_disk"])  # the loaded state went to disk at the step
