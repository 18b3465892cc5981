"""`offload="host"` (engine/offload.py): shards, gradients and optimizer state in host memory,
a device copy in the compute dtype for gathers. On CPU the device copy is still a tensor of its
own, so exactness and what lives where are tested here: N ranks against one process (and bit
for bit against the same run without offload), Trainer and Fabric end to end, no host read on
the hot path, a sharded checkpoint resumed at another world size."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, ShardingConfig, clip_grad_norm_
from tests.support import models
from tests.support.adapted import HandsBack, launched
from tests.support.cuda_standin import standin
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
        # Views of one buffer per unit: offloaded its host staging row, else its reduced buffer.
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
            plain = result[gathers]["plain"]
            assert plain["grad_storages"][0] < plain["grad_storages"][1] and plain["device_bytes"] == 0
            assert host["grad_storages"] == plain["grad_storages"]  # engine/offload.py, Note: staging reused


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


ZERO_GRAD = {"set_to_none": (True, 1), "zeros": (False, 1), "accumulate 2": (True, 2)}  # (set_to_none, backwards)


def _copies_per_step(rank: int, world_size: int) -> dict[str, Any]:
    """Under the CUDA stand-in: what the offload's uploads and downloads copy and allocate, and
    the host's waits, per step, for each way of `ZERO_GRAD`."""
    torch.manual_seed(0)
    x, y = models.mlp_batch(0)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    out: dict[str, Any] = {}
    seen = Counter[str]()  # this step's, by direction
    with standin() as mode:
        for name, (set_to_none, backwards) in ZERO_GRAD.items():
            model = models.MLP(depth=3)  # 4 units of 2 to 6 parameters
            sharded = ShardedModel(model, **HOST)
            offload = sharded._offload

            def counted(direction: str, method: Any) -> Any:
                def call(*args: Any, **kwargs: Any) -> Any:
                    before = Counter(mode.counts)
                    try:
                        return method(*args, **kwargs)
                    finally:
                        for key in ("copies", "allocations"):
                            seen[f"{direction} {key}"] += mode.counts[key] - before[key]

                return call

            offload.download = counted("down", offload.download)
            offload._current_copy = counted("up", offload._current_copy)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            steps = []
            for _ in range(4):
                seen.clear()
                waits = Counter(mode.api.host_waits)
                for _ in range(backwards):
                    F.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=set_to_none)
                steps.append({**seen, **(mode.api.host_waits - waits)})
            rows = [s.row for kept in offload._staging.values() for s in kept]
            shards = sum(p.param.nbytes for p in sharded.sharded_params if p.requires_grad)
            out[name] = {"steps": steps, "rows_per_shard_byte": sum(r.nbytes for r in rows) / shards}
        out["units"] = len(sharded._units)
        out["params"] = len(sharded.sharded_params)
        out["races"] = mode.races[:3]
    return out


@pytest.mark.slow
def test_offload_copies_once_per_unit_and_direction_reuses_its_staging_and_waits_on_an_event() -> None:
    """Before: a new host tensor and a copy per parameter per backward, a copy per parameter per
    upload, and a synchronize of the whole stream (engine/offload.py, Note: staging reused)."""
    for result in run_ranks(_copies_per_step, 2):
        units, params = result["units"], result["params"]
        assert params > units and result["races"] == [], result
        for name, (set_to_none, backwards) in ZERO_GRAD.items():
            for step in result[name]["steps"][2:]:  # steady: the staging rows exist
                copies = {"up copies": backwards * units, "down copies": backwards * units, "up allocations": 0,
                          "down allocations": 0, "event.synchronize": backwards}  # fmt: skip
                assert step == copies, (name, step)
            # Host gradient memory (docs/accounting.md, Offload): one row per unit, a second one
            # where a backward found `.grad` alive.
            rows = 1 if set_to_none and backwards == 1 else 2
            assert result[name]["rows_per_shard_byte"] == rows, (name, result[name])


def _kept_gradient(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    model = models.MLP()
    ShardedModel(model, **HOST)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = None
    for step in range(2):
        x, y = models.mlp_batch(step)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        if kept is None:
            kept = [(p.grad, p.grad.clone()) for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return all(torch.equal(grad, value) for grad, value in kept)


def test_a_gradient_kept_past_zero_grad_is_not_overwritten_by_the_next_backward() -> None:
    """The staging row its view came from is reused only once no such view is alive."""
    assert all(run_ranks(_kept_gradient, 2))


def _reused_block(rank: int, world_size: int) -> float:
    """A block called twice in one forward is reduced twice in its backward: both downloads arrive."""
    x, y = models.mlp_batch(0)
    grads = []
    for options in ({}, HOST):
        torch.manual_seed(0)
        model = models.ReusedBlockModel()
        ShardedModel(model, **options)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        grads.append([p.grad for p in model.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*grads))


def test_a_unit_reduced_twice_in_one_backward_gets_both_gradients() -> None:
    assert max(run_ranks(_reused_block, 2)) == 0.0


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
