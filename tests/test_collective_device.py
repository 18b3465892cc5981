"""Collectives take tensors of their group's device only (comm.py, Note: collective device), so
what NCCL would crash on fails here on gloo too; teardown leaves the optimizer state on the device,
and a full save after `fit` of state moved off it anyway sends it from the group's device."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lightning_zero3.engine.comm import CollectiveError, Comm
from tests.lit import LitMLP, become_lightning_rank, loader, trainer
from tests.ranks import run_ranks


def test_a_collective_refuses_a_tensor_off_its_groups_device() -> None:
    comm = Comm(None, device=torch.device("cuda", 0))  # a device group, as NCCL's is
    with pytest.raises(CollectiveError, match=r"All-Gather of x: a tensor on cpu.*take cuda tensors"):
        comm.all_gather(torch.zeros(4), torch.zeros(4), async_op=False, what="x")
    with pytest.raises(CollectiveError, match="All-Reduce of y: a tensor on cpu"):
        comm.all_reduce(torch.zeros(1), what="y")
    Comm(None, device=torch.device("cpu")).all_reduce(torch.zeros(1), what="z")  # on its device: fine


class _OffDevice(torch.Tensor):
    """A host tensor that says it is on another device: on a CPU-only machine, the stand-in for
    Lightning's teardown moving CUDA optimizer state to the host while the group is NCCL's."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("meta")


def _moved_off_device(optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.as_subclass(_OffDevice)


def _full_save_after_fit(rank: int, world_size: int, path: str) -> Any:
    become_lightning_rank(rank, world_size)
    import lightning.pytorch.strategies.strategy as lightning_strategy

    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP()
    t = trainer(ZeRO3Strategy(state_dict_type="full"), world_size, max_steps=2)
    moves: list[str] = []
    lightning_strategy._optimizers_to_device = lambda *args: moves.append("optimizer state")  # type: ignore[assignment]
    model.cpu = lambda: moves.append("module")  # type: ignore[method-assign, assignment, return-value]
    t.fit(model, loader(world_size))
    # State moved off the device anyway (by user code): the full save still sends it from the group's.
    _moved_off_device(t.optimizers, torch.device("cpu"))
    t.save_checkpoint(path)
    return moves


def test_full_save_after_fit_gathers_state_moved_off_the_device(tmp_path: Any) -> None:
    """Teardown moves neither the module nor the optimizer state to the host (as Lightning's
    FSDPStrategy); state moved off the device anyway is still sent from the group's device."""
    path = os.path.join(tmp_path, "model.ckpt")
    assert run_ranks(_full_save_after_fit, 2, path) == [[], []]
    checkpoint = torch.load(path, weights_only=False)
    exp_avg = checkpoint["optimizer_states"][0]["state"][0]["exp_avg"]
    assert type(exp_avg) is torch.Tensor and exp_avg.shape == (13, 7) and exp_avg.abs().sum() > 0
