"""A user's own `state_dict()` and `load_state_dict()` around `fit`, written as DeepSpeed's
`GatheredParameters` users write them (common/run.py, Note: a module's own state_dict): inside
`strategy.gathered_parameters(...)` the model and any submodule answer with whole tensors (rank 0
saves them with `torch.save`; a fresh module in one process loads them, equal to one process's
run); everywhere else (a callback during `fit`, the module at rest after it) every level refuses
on every rank, naming the fixes, where a submodule used to answer with its 1-D shards; a load
into shards is refused, and a load inside with `modifier_rank=0` on rank 0 alone is kept on every
rank. 2 gloo ranks (Trainer, Fabric, the bare engine) against one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.support import models
from tests.support.fabric_helpers import adamw, every_rank, launch, reference, train_step
from tests.support.lit import LitMLP, become_lightning_rank, loader, max_difference, reference_fit, trainer
from tests.support.ranks import run_ranks

TOL = 1e-5
FIXES = ("gathered_parameters", "full_state_dict()", "save_checkpoint")


def attempt(fn: Callable[[], Any]) -> Any:
    """What the user's line gives: its value, or the text of the error it raised."""
    try:
        return fn()
    except RuntimeError as err:
        return f"raised: {err}"


def shapes(state: Any) -> Any:
    return {k: tuple(v.shape) for k, v in state.items()} if isinstance(state, dict) else state


class ReadsDuringFit(pl.Callback):
    """A user's callback reading the weights at the end of each epoch."""

    def __init__(self) -> None:
        self.outside: list[Any] = []
        self.inside: list[Any] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.outside += [attempt(pl_module.state_dict), attempt(pl_module.net.head.state_dict)]
        with trainer.strategy.gathered_parameters(pl_module):
            self.inside.append(attempt(lambda: shapes(pl_module.state_dict())))


def _fit_then_read(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP()
    reads = ReadsDuringFit()
    fit = trainer(ZeRO3Strategy(), world_size, max_epochs=1, callbacks=[reads])
    fit.fit(model, loader(world_size))
    strategy = fit.strategy
    out: dict[str, Any] = {"during_fit_outside": reads.outside, "during_fit_inside": reads.inside}
    # At rest: the model and a submodule.
    out["at_rest"] = [attempt(model.state_dict), attempt(model.net.blocks[0].state_dict)]
    with strategy.gathered_parameters(model):  # every rank
        state = attempt(model.state_dict)
        if rank == 0 and isinstance(state, dict):
            torch.save(state, Path(directory) / "model.pt")
        out["root_inside"] = shapes(state)
        out["block_inside"] = attempt(lambda: shapes(model.net.blocks[0].state_dict()))
        out["head_weight"] = model.net.head.weight.clone()
        copies = {k: v.clone() for k, v in state.items()} if isinstance(state, dict) else {}
    out["kept_after_block"] = max_difference(state, copies) if copies else state
    with strategy.gathered_parameters(model.net.blocks[1]):  # a submodule only
        out["scoped_block"] = attempt(lambda: shapes(model.net.blocks[1].state_dict()))
        out["scoped_root"] = attempt(model.state_dict)
    # Loads: into shards, inside without modifier_rank, then inside with it on rank 0 alone.
    whole = strategy.full_state_dict(rank0_only=False)
    target = {k: v + 1 for k, v in whole.items()}
    out["load_at_rest"] = attempt(lambda: model.load_state_dict(target))
    with strategy.gathered_parameters(model):
        out["load_dropped"] = attempt(lambda: model.load_state_dict(target))
    out["unchanged_by_refusals"] = max_difference(strategy.full_state_dict(rank0_only=False), whole)
    with strategy.gathered_parameters(model, modifier_rank=0):
        if rank == 0:
            model.load_state_dict(target)
    out["loaded"] = max_difference(strategy.full_state_dict(rank0_only=False), target)
    return out


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("user_state_dict")


@pytest.fixture(scope="module")
def results(directory: Path) -> list[dict[str, Any]]:
    return run_ranks(_fit_then_read, 2, str(directory), timeout_s=120)


@pytest.fixture(scope="module")
def one_process() -> LitMLP:
    torch.manual_seed(0)
    model = LitMLP()
    reference_fit(model, epochs=1)
    return model


@pytest.mark.slow
def test_torch_save_of_state_dict_inside_gathered_parameters_loads_into_a_fresh_module_equal_to_one_process(
    results: list[dict[str, Any]], directory: Path, one_process: LitMLP
) -> None:
    fresh = LitMLP()
    fresh.load_state_dict(torch.load(directory / "model.pt"))
    assert max_difference(fresh.state_dict(), one_process.state_dict()) < TOL


def test_inside_gathered_parameters_the_model_a_submodule_and_a_weight_are_whole_on_every_rank(
    results: list[dict[str, Any]], one_process: LitMLP
) -> None:
    block = shapes(one_process.net.blocks[0].state_dict())
    for result in results:
        assert result["root_inside"] == shapes(one_process.state_dict()), result["root_inside"]
        assert result["block_inside"] == block, result["block_inside"]
        assert float((result["head_weight"].detach() - one_process.net.head.weight.detach()).abs().max()) < TOL


def test_gathered_parameters_of_a_submodule_makes_its_state_dict_whole_and_the_rest_refuses(
    results: list[dict[str, Any]], one_process: LitMLP
) -> None:
    for result in results:
        assert result["scoped_block"] == shapes(one_process.net.blocks[1].state_dict())
        assert "raised" in result["scoped_root"] and "'net.inp.weight'" in result["scoped_root"], result["scoped_root"]


def test_a_state_dict_taken_inside_stays_whole_and_unchanged_after_the_block(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["kept_after_block"] == 0.0, result["kept_after_block"]


def test_in_a_callback_during_fit_state_dict_refuses_outside_and_is_whole_inside(
    results: list[dict[str, Any]], one_process: LitMLP
) -> None:
    for result in results:
        for refused in result["during_fit_outside"]:
            assert isinstance(refused, str) and all(fix in refused for fix in FIXES), refused
        assert result["during_fit_inside"] == [shapes(one_process.state_dict())]


def test_at_rest_the_model_and_every_submodule_refuse_on_every_rank_naming_the_fixes(
    results: list[dict[str, Any]],
) -> None:
    for result in results:
        root, block = result["at_rest"]
        assert isinstance(root, str) and all(fix in root for fix in FIXES), root
        assert isinstance(block, str) and all(fix in block for fix in FIXES), block  # was: 1-D shards
        assert "'fc1.weight'" in block or "'norm.weight'" in block, block  # named as the user called it


def test_load_state_dict_into_shards_or_inside_without_modifier_rank_is_refused_and_changes_nothing(
    results: list[dict[str, Any]],
) -> None:
    for result in results:
        assert "raised" in result["load_at_rest"] and "modifier_rank=0" in result["load_at_rest"]
        assert "raised" in result["load_dropped"] and "without `modifier_rank`" in result["load_dropped"]
        assert result["unchanged_by_refusals"] == 0.0


def test_load_state_dict_on_rank_0_inside_gathered_parameters_with_modifier_rank_is_kept_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    for result in results:
        assert result["loaded"] == 0.0


# ---- Fabric: the same reads in a plain loop ------------------------------------------------------------
STEPS = 3


def _train_then_read(fabric: Any, directory: str) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = fabric.setup_module(models.MLP())
    optimizer = fabric.setup_optimizers(adamw(model))
    for step in range(STEPS):
        train_step(fabric, model, optimizer, step, fabric.global_rank, fabric.world_size, None)
    out: dict[str, Any] = {"outside": [attempt(model.state_dict), attempt(model.blocks[0].state_dict)]}
    with fabric.strategy.gathered_parameters(model):
        state = attempt(model.state_dict)
        if fabric.global_rank == 0 and isinstance(state, dict):
            torch.save(state, Path(directory) / "fabric.pt")
        out["block"] = attempt(lambda: shapes(model.blocks[0].state_dict()))
    out["load_outside"] = attempt(lambda: model.load_state_dict(state))
    return every_rank(out)


@pytest.mark.slow
def test_fabric_state_dict_inside_gathered_parameters_is_whole_and_outside_every_level_refuses(tmp_path: Path) -> None:
    results = launch(_train_then_read, str(tmp_path))
    expected, _ = reference(STEPS)
    fresh = models.MLP()
    fresh.load_state_dict(torch.load(tmp_path / "fabric.pt"))
    assert max_difference(fresh.state_dict(), expected.state_dict()) < TOL
    for result in results:
        assert result["block"] == shapes(expected.blocks[0].state_dict())
        for refused in result["outside"]:
            assert isinstance(refused, str) and "fabric.strategy.gathered_parameters" in refused, refused
        assert "raised" in result["load_outside"] and "fabric.load" in result["load_outside"]


# ---- the bare engine ----------------------------------------------------------------------------------
def _engine_inside(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_zero3.engine import ShardedModel

    torch.manual_seed(0)
    model = models.MLP()
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    sharded = ShardedModel(model)
    with sharded.gathered_parameters():
        state = model.state_dict()
        block = model.blocks[0].state_dict()
    with sharded.gathered_parameters():  # the next gather reuses the pooled block
        pass
    expected_block = shapes(models.MLP().blocks[0].state_dict())
    return {"state": max_difference(state, whole), "block": shapes(block) == expected_block}


def test_engine_state_dicts_taken_inside_gathered_parameters_are_whole_and_stay_valid_after_it() -> None:
    for result in run_ranks(_engine_inside, 2):
        assert result == {"state": 0.0, "block": True}
