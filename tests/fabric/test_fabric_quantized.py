"""Fabric training with `ZeRO3FabricStrategy(quantize_weights=True, quantize_gradients=True)` as
users write it (`fabric.launch`, 2 gloo ranks), saving a sharded or a full checkpoint: the loss
stays within LOSS_BOUND of one process's exact run, `fabric.save` holds the fp32 master shards bit
for bit (loaded back after another step, they come back unchanged), and `state_dict()` inside
`gathered_parameters` is the whole unquantized weights (Trainer's: tests/lightning/test_strategy_quantized.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support import models
from tests.support.fabric_helpers import adamw, every_rank, full_state, launch, reference, train_step

LOSS_BOUND = 0.01  # relative, each step's loss
STEPS = 6


def _train_save_load(fabric: Any, directory: str) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    module = models.MLP()
    model, optimizer = fabric.setup(module, adamw(module))
    rank, world_size = fabric.global_rank, fabric.world_size
    losses = [train_step(fabric, model, optimizer, step, rank, world_size, None)[0] for step in range(STEPS)]
    master = {k: v.detach().clone() for k, v in module.named_parameters()}  # this rank's fp32 shards
    path = f"{directory}/checkpoint"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    with fabric.strategy.gathered_parameters(model):
        gathered = {k: v.detach().clone() for k, v in module.state_dict().items()}
    whole = full_state(fabric, model)
    train_step(fabric, model, optimizer, STEPS, rank, world_size, None)  # the shards move on
    fabric.load(path, {"model": model, "optimizer": optimizer})
    loaded = {k: v.detach().clone() for k, v in module.named_parameters()}
    return every_rank({"losses": losses, "master": master, "loaded": loaded, "gathered": gathered, "whole": whole})


@pytest.fixture(scope="module", params=["sharded", "full"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp(request.param)
    return launch(_train_save_load, str(directory), quantize_weights=True, quantize_gradients=True,
                  state_dict_type=request.param)  # fmt: skip


@pytest.mark.slow
def test_the_loss_stays_within_the_bound_of_one_process_exact_run(run: list[dict[str, Any]]) -> None:
    exact = [loss for loss, _ in reference(STEPS)[1]]
    for rank in run:
        worst = max(abs(q / e - 1) for q, e in zip(rank["losses"], exact))
        assert len(rank["losses"]) == STEPS and worst <= LOSS_BOUND, (worst, rank["losses"], exact)
        assert rank["losses"] != exact  # quantization was on


@pytest.mark.slow
def test_the_checkpoint_loads_the_master_shards_bit_for_bit(run: list[dict[str, Any]]) -> None:
    for rank in run:
        master, loaded = rank["master"], rank["loaded"]
        assert loaded.keys() == master.keys() and all(torch.equal(loaded[k], master[k]) for k in master)


@pytest.mark.slow
def test_state_dict_inside_gathered_parameters_is_the_whole_unquantized_weights(run: list[dict[str, Any]]) -> None:
    for index, rank in enumerate(run):
        gathered, whole = rank["gathered"], rank["whole"]
        assert gathered.keys() == whole.keys() and all(torch.equal(gathered[k], whole[k]) for k in whole)
        for name, shard in rank["master"].items():  # the whole weights cut as the shards are: the shards
            flat = whole[name].reshape(-1)
            start = index * shard.numel()
            piece = flat[start : start + shard.numel()]
            assert torch.equal(piece, shard[: piece.numel()]), name
