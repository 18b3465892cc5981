"""Collectives take tensors of their group's device only (comm.py, Note: collective device), so
what NCCL would crash on fails here on gloo too; teardown leaves the optimizer state on the device,
and a full save after `fit` of state moved off it anyway sends it from the group's device."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero3.engine.comm import CollectiveError, Comm
from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, loader, trainer


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


class _SavesStateMovedOffTheDevice(pl.Callback):
    """Records on the module each move of the module or the optimizer state to the host during the
    run; after `fit` (the strategy torn down) moves the optimizer state off the device, as user code
    could, and saves."""

    def __init__(self, path: str) -> None:
        self.path = path

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import lightning.pytorch.strategies.strategy as lightning_strategy

        moves: list[str] = []
        pl_module.moves = moves
        lightning_strategy._optimizers_to_device = lambda *args: moves.append("optimizer state")  # type: ignore[assignment]
        pl_module.cpu = lambda: moves.append("module")  # type: ignore[method-assign, assignment, return-value]

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _moved_off_device(trainer.optimizers, torch.device("cpu"))
        trainer.save_checkpoint(self.path)


def test_full_save_after_fit_gathers_state_moved_off_the_device(tmp_path: Any) -> None:
    """Teardown moves neither the module nor the optimizer state to the host (as Lightning's
    FSDPStrategy); state moved off the device anyway is still sent from the group's device."""
    path = os.path.join(tmp_path, "model.ckpt")
    torch.manual_seed(0)
    callbacks = [_SavesStateMovedOffTheDevice(path), HandsBack(moves="lightning_module.moves")]
    fit = trainer(launched("zero3", state_dict_type="full"), 2, max_steps=2, callbacks=callbacks)
    fit.fit(LitMLP(), loader(2))
    assert fit.callback_metrics["moves"] == [[], []]
    checkpoint = torch.load(path, weights_only=False)
    exp_avg = checkpoint["optimizer_states"][0]["state"][0]["exp_avg"]
    assert type(exp_avg) is torch.Tensor and exp_avg.shape == (13, 7) and exp_avg.abs().sum() > 0
