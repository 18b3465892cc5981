"""`Fabric(strategy="zero3")` trains a plain nn.Module exactly like one process on the global
batch: 2 real gloo ranks against a single-process reference, through every way Fabric sets a
model and its optimizer up.

The ranks are started as users start them, by `fabric.launch(fn)` and Fabric's multiprocessing
launcher (tests/support/fabric_helpers.py `launch`); each launched function hands back every rank's view
(`every_rank`). Two tests run on `run_ranks` ranks instead: the misuse and missing-path tests,
whose point is that each rank raises the same error (the harness reports each rank's outcome,
the launcher the first failure); and the threads test, which is about ranks started outside
Fabric (Fabric's launcher sets the threads itself)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from tests.support import models
from tests.support.fabric_helpers import (
    adamw,
    every_rank,
    fabric,
    full_state,
    launch,
    max_difference,
    reference,
    train_step,
)
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks

TOL = 1e-5
STEPS = 3
CLIP = 0.05


def _train(f: L.Fabric, how: str) -> list[dict[str, Any]]:
    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    if how == "init_module_empty":
        with f.init_module(empty_init=True):
            model = models.MLP()
        on_meta = all(p.is_meta for p in model.parameters())
        torch.manual_seed(0)  # materialised module by module in construction order: same values
        model = f.setup_module(model)
        optimizer = f.setup_optimizers(adamw(model))
    elif how == "setup_together":  # the optimizer holds the whole parameters until setup
        model = models.MLP()
        model, optimizer = f.setup(model, adamw(model))
    elif how == "setup_module_then_optimizer":
        model = f.setup_module(models.MLP())
        optimizer = f.setup_optimizers(adamw(model))
    else:  # "optimizer_before_setup_module"
        model = models.MLP()
        optimizer = adamw(model)
        model = f.setup_module(model)
        optimizer = f.setup_optimizers(optimizer)
    shard_shapes = {tuple(p.shape) for p in model.parameters()}
    steps = [train_step(f, model, optimizer, step, rank, world_size, CLIP) for step in range(STEPS)]
    return every_rank({
        "state": full_state(f, model),
        "steps": steps,
        "shard_shapes": shard_shapes,
        "on_meta": how != "init_module_empty" or on_meta,
    })  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "how", ["setup_together", "setup_module_then_optimizer", "optimizer_before_setup_module", "init_module_empty"]
)
def test_training_matches_single_process_with_global_norm_clipping(how: str) -> None:
    results = launch(_train, how)
    model, expected = reference(STEPS, clip=CLIP)
    assert all(norm > CLIP for _, norm in expected), "the clip value must actually clip"
    for result in results:
        assert result["on_meta"], "init_module(empty_init=True) must build on the meta device"
        assert all(len(shape) == 1 for shape in result["shard_shapes"]), "parameters must be 1-D shards"
        assert max_difference(result["state"], model.state_dict()) < TOL
        for (loss, norm), (ref_loss, ref_norm) in zip(result["steps"], expected):
            assert abs(loss - ref_loss) < TOL
            assert abs(norm - ref_norm) < TOL


def _misuse(rank: int, world_size: int) -> dict[str, str]:
    f = fabric(rank, world_size)
    errors = {}
    stepped = models.MLP()
    optimizer = torch.optim.SGD(stepped.parameters(), lr=0.1, momentum=0.9)
    stepped(torch.randn(2, 7)).sum().backward()
    optimizer.step()
    try:
        f.setup(stepped, optimizer)
    except ValueError as err:
        errors["stepped"] = str(err)
    try:
        f.setup(models.MLP(), torch.optim.SGD(models.MLP().parameters(), lr=0.1))
    except ValueError as err:
        errors["foreign_together"] = str(err)
    model = f.setup_module(models.MLP())
    try:
        f.setup_optimizers(torch.optim.SGD(models.MLP().parameters(), lr=0.1))
    except ValueError as err:
        errors["foreign"] = str(err)
    try:
        f.setup_module(model.module)
    except ValueError as err:
        errors["twice"] = str(err)
    return errors


def test_misuse_gives_clear_errors_on_every_rank() -> None:
    for errors in run_ranks(_misuse, 2):
        assert "has already stepped" in errors["stepped"] and "after `fabric.setup_module(model)`" in errors["stepped"]
        assert "holds parameters of no model set up" in errors["foreign"]
        assert "holds parameters that are not the model's" in errors["foreign_together"]
        assert "set up each module once" in errors["twice"]


def _load_missing(rank: int, world_size: int, missing: str) -> dict[str, str]:
    f = fabric(rank, world_size)
    plain = models.MLP()
    model, optimizer = f.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    errors = {}
    for how, state in (("state", {"model": model, "optimizer": optimizer}), ("raw", model)):
        try:
            f.load(missing, state) if how == "state" else f.load_raw(missing, model)
        except FileNotFoundError as err:
            errors[how] = f"{type(err).__name__}: {err}"
    return errors


def test_loading_a_missing_path_is_file_not_found_on_every_rank(tmp_path: Any) -> None:
    missing = str(tmp_path / "never-saved.ckpt")
    for errors in run_ranks(_load_missing, 2, missing):
        assert set(errors) == {"state", "raw"}, errors
        for message in errors.values():
            assert message.startswith("CheckpointNotFoundError: Checkpoint file not found") and missing in message


def test_zero3_name_builds_the_fabric_strategy() -> None:
    from lightning_zero3 import ZeRO3FabricStrategy

    assert type(L.Fabric(strategy="zero3", accelerator="cpu", devices=2).strategy) is ZeRO3FabricStrategy
    strategy = ZeRO3FabricStrategy(prefetch=2, state_dict_type="full")
    assert L.Fabric(strategy=strategy, accelerator="cpu", devices=2).strategy is strategy


def test_each_class_given_to_the_other_api_names_the_right_one() -> None:
    from lightning_zero3 import ZeRO3FabricStrategy, ZeRO3Strategy

    with pytest.raises(ValueError, match="for Fabric use ZeRO3FabricStrategy or strategy='zero3'"):
        L.Fabric(strategy=ZeRO3Strategy(), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="for the Trainer use ZeRO3Strategy or strategy='zero3'"):
        L.Trainer(strategy=ZeRO3FabricStrategy(), accelerator="cpu", devices=2)


def _save_after_two_steps(f: L.Fabric, directory: str) -> None:
    from lightning_zero3 import ZeRO3FabricStrategy

    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    model = models.MLP()
    model, optimizer = f.setup(model, adamw(model))
    for step in range(2):
        train_step(f, model, optimizer, step, rank, world_size, None)
    f.save(f"{directory}/sharded", {"model": model, "optimizer": optimizer, "step": 2, "note": {"a": 1}})
    # A second Fabric reads the sharded checkpoint and writes it as one full file.
    full = fabric(rank, world_size, strategy=ZeRO3FabricStrategy(state_dict_type="full"))
    other = full.setup_module(models.MLP())
    other_optimizer = full.setup_optimizers(adamw(other))
    state = {"model": other, "optimizer": other_optimizer, "step": 0}
    remainder = full.load(f"{directory}/sharded", state)
    assert state["step"] == 2 and remainder == {"note": {"a": 1}}, (state["step"], remainder)
    full.save(f"{directory}/full.pt", {"model": other, "optimizer": other_optimizer, "step": state["step"]})


def _resume_and_step(launched: L.Fabric, directory: str) -> list[dict[str, Any]]:
    rank, world_size = launched.global_rank, launched.world_size
    out = {}
    for name in ("sharded", "full.pt"):
        f = fabric(rank, world_size)
        model = f.setup_module(models.MLP())
        optimizer = f.setup_optimizers(adamw(model))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        f.load(f"{directory}/{name}", state)
        out[name] = {"step": state["step"], "loss": train_step(f, model, optimizer, 2, rank, world_size, None)[0]}
        out[name]["state"] = full_state(f, model)
    f = fabric(rank, world_size)
    model = f.setup_module(models.MLP())
    f.load_raw(f"{directory}/raw.pt", model)  # a plain state dict of whole tensors
    out["raw"] = full_state(f, model)
    return every_rank(out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Checkpoints of 2 ranks after 2 steps: `sharded` (a directory) and `full.pt`."""
    directory = tmp_path_factory.mktemp("fabric_checkpoints")
    launch(_save_after_two_steps, str(directory))
    torch.save(reference(2)[0].state_dict(), directory / "raw.pt")
    return directory


@pytest.mark.slow
def test_sharded_and_full_checkpoints_resume_at_another_world_size(saved: Any) -> None:
    results = launch(_resume_and_step, str(saved), devices=3)
    model, expected = reference(3)
    for result in results:
        for name in ("sharded", "full.pt"):
            assert result[name]["step"] == 2
            assert abs(result[name]["loss"] - expected[2][0]) < TOL
            assert max_difference(result[name]["state"], model.state_dict()) < TOL
        assert max_difference(result["raw"], reference(2)[0].state_dict()) == 0.0


@pytest.mark.slow
def test_full_checkpoint_is_what_a_plain_pytorch_run_reads(saved: Any) -> None:
    checkpoint = torch.load(saved / "full.pt", weights_only=True)
    plain = models.MLP()
    plain.load_state_dict(checkpoint["model"])
    optimizer = adamw(plain)
    optimizer.load_state_dict(checkpoint["optimizer"])
    x, y = models.mlp_batch(2)
    torch.nn.functional.mse_loss(plain(x), y).backward()
    optimizer.step()
    assert checkpoint["step"] == 2
    assert max_difference(plain.state_dict(), reference(3)[0].state_dict()) < TOL


def _bf16_mixed_and_clip_by_value(f: L.Fabric) -> list[dict[str, Any]]:
    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    model = f.setup_module(models.MLP())
    optimizer = f.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    sharded = f.strategy.sharded_model(model)
    gathered: set[torch.dtype] = set()
    model.blocks[0].fc1.register_forward_pre_hook(lambda m, a: gathered.add(m.weight.dtype))
    # Asked before the first step: no order recorded yet, so only the root is kept for backward.
    expected = sharded.stats.expected_step_bytes()["all_gather"]
    x, y = models.mlp_batch(0)
    loss = torch.nn.functional.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    f.backward(loss)
    f.clip_gradients(model, optimizer, clip_val=0.01)
    largest = max(float(p.grad.abs().max()) for p in model.parameters())
    optimizer.step()  # closes the step's accounting: stats.last_step is this step's traffic
    return every_rank({"gathered": gathered, "shards": {p.dtype for p in model.parameters()}, "largest": largest,
                       "gather_bytes": sharded.stats.shard_group.last_step["all_gather"].payload_bytes,
                       "expected": expected, "state": full_state(f, model)})  # fmt: skip


def test_bf16_mixed_gathers_in_bf16_and_clipping_by_value_acts_on_shards() -> None:
    torch.manual_seed(0)
    model = models.MLP()
    x, y = models.mlp_batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    assert max(float(p.grad.abs().max()) for p in model.parameters()) > 0.01, "the clip value must clip"
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for result in launch(_bf16_mixed_and_clip_by_value, precision="bf16-mixed"):
        assert result["gathered"] == {torch.bfloat16} and result["shards"] == {torch.float32}
        assert result["gather_bytes"] == result["expected"]
        assert result["largest"] <= 0.01
        assert max_difference(result["state"], model.state_dict()) < 1e-3


def _host_reads_of_clipping(f: L.Fabric) -> list[dict[str, Any]]:
    from tests.support.host_reads import counting_host_reads

    rank, world_size = f.global_rank, f.world_size
    torch.manual_seed(0)
    model = models.MLP()
    model, optimizer = f.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = models.mlp_batch(0)
    f.backward(torch.nn.functional.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)))
    reads = {}
    for check in (False, True):
        with counting_host_reads() as counter:
            f.clip_gradients(model, optimizer, max_norm=1e6, error_if_nonfinite=check)
        reads[check] = counter.count
    first, *others = model.parameters()
    first.grad.fill_(float("inf"))
    before = [p.grad.clone() for p in others]
    with pytest.raises(RuntimeError) as raised:
        f.clip_gradients(model, optimizer, max_norm=1.0)
    untouched = all(torch.equal(p.grad, g) for p, g in zip(others, before))
    return every_rank({"reads": reads, "error": str(raised.value), "untouched": untouched})


def test_fabric_clipping_reads_the_norm_on_the_host_only_to_check_it_is_finite() -> None:
    """`error_if_nonfinite=True` (Fabric's default) must read the norm to raise at the call, as
    torch's `clip_grad_norm_` does; False clips without stopping a GPU's queue."""
    for result in launch(_host_reads_of_clipping):
        assert result["reads"] == {False: 0, True: 1}, result
        assert "is non-finite" in result["error"] and "error_if_nonfinite=False" in result["error"], result
        assert result["untouched"], "the gradients were scaled before the error (torch raises first)"


def _gathered(f: L.Fabric) -> list[dict[str, Any]]:
    rank = f.global_rank
    torch.manual_seed(0)
    model = f.setup_module(models.MLP())
    with f.strategy.gathered_parameters(model.head):
        inside = tuple(model.head.weight.shape)
    with f.strategy.gathered_parameters(model.head, modifier_rank=1):
        if rank == 1:
            model.head.weight.data.fill_(0.5)
    state = full_state(f, model)
    model(torch.randn(4, 7)).sum().backward()  # a step's buffers in the pool
    pool = f.strategy.sharded_model(model)._pool
    pooled = pool.cached_bytes
    f.strategy.release_buffers(model)
    released = (pooled, pool.cached_bytes)
    outside = tuple(model.head.weight.shape)
    return every_rank({"inside": inside, "outside": outside, "state": state, "released": released})


@pytest.fixture(scope="module")
def gathered() -> list[dict[str, Any]]:
    return launch(_gathered)


def test_gathered_parameters_gives_whole_weights_and_keeps_the_modifiers_writes(gathered) -> None:
    for result in gathered:
        assert result["inside"] == (5, 13) and len(result["outside"]) == 1
        assert torch.equal(result["state"]["head.weight"], torch.full((5, 13), 0.5))


def test_release_buffers_empties_the_engines_pool(gathered) -> None:
    """`strategy.release_buffers()` (both strategies, common/base.py) gives the pooled buffers back."""
    for result in gathered:
        pooled, after = result["released"]
        assert pooled > 0 and after == 0, result


def _threads_after_launch(rank: int, world_size: int) -> tuple[int, int]:
    import os

    share = max(1, len(os.sched_getaffinity(0)) // world_size)
    os.environ.pop("OMP_NUM_THREADS", None)  # as in a rank started by torchrun or by Fabric itself
    torch.set_num_threads(share + 3)
    fabric(rank, world_size)
    return torch.get_num_threads(), share


def test_ranks_started_outside_fabric_get_their_share_of_the_cores() -> None:
    for threads, share in run_ranks(_threads_after_launch, 2):
        assert threads == share, (threads, share)


def _refused_strict_load(fabric: L.Fabric, directory: str, kind: str) -> list[dict[str, bool]]:
    torch.manual_seed(0)
    module = models.MLP()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=0.1))
    path = f"{directory}/{kind}"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    stepped = {k: v.detach().clone() for k, v in module.named_parameters()}  # this rank's shards
    with pytest.raises(KeyError, match=r"asks for \['epoch'\]"):
        fabric.load(path, {"model": model, "optimizer": optimizer, "epoch": 0})
    return every_rank({"unchanged": all(torch.equal(stepped[k], v) for k, v in module.named_parameters())})


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_strict_load_refused_for_a_missing_key_leaves_the_model_as_it_was(tmp_path, kind: str) -> None:
    """Every check of `fabric.load` runs before anything is loaded, as in Lightning's own strategies."""
    for result in launch(_refused_strict_load, str(tmp_path), kind, state_dict_type=kind):
        assert result["unchanged"]


def _stall_in_the_replicate_group(rank: int, world_size: int, flag: str) -> str:
    """Rank 1 never enters backward's All-Reduce over the replicate group (shard_size=1); rank 0's
    error, then its flag file, let rank 1 go (after 90 s at most)."""
    import time
    from datetime import timedelta
    from pathlib import Path

    from lightning_zero3 import ZeRO3FabricStrategy

    f = fabric(rank, world_size, strategy=ZeRO3FabricStrategy(shard_size=1, timeout=timedelta(seconds=5)))
    model = f.setup_module(models.MLP())
    if rank == 1:
        for _ in range(900):
            if Path(flag).exists():
                break
            time.sleep(0.1)
        return ""
    try:
        f.backward(model(torch.randn(4, 7)).sum())
        return "no error"
    except RuntimeError as err:
        return str(err)
    finally:
        Path(flag).touch()


@pytest.mark.slow
def test_a_rank_stalled_on_a_side_group_fails_the_other_after_the_strategys_timeout(tmp_path) -> None:
    """The groups `shard_size` makes time out after `timeout` as the default group does, not
    after torch's 30 min (torch 2.13's `new_group` does not inherit the default group's)."""
    error, _ = run_ranks(_stall_in_the_replicate_group, 2, str(tmp_path / "flag"))
    assert "Timed out" in error and "5000ms" in error, error
