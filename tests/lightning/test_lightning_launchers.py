"""End-to-end runs started by Lightning's own launcher, as Lightning's tests and users start them:
the test process builds the Trainer or Fabric and calls `fit` / `launch`, and the strategy's
multiprocessing launcher (`start_method="spawn"`, as Lightning's "ddp_spawn") starts the 2 CPU
ranks and hands rank 0's results back. The other adapted Lightning tests launch the same way from
the forkserver of tests/support/ranks.py (tests/support/adapted.py `launched`), which has imported torch and
Lightning once; these check "spawn", which imports them per rank, as users' "ddp_spawn" does.
Lightning's subprocess launcher (the default, which re-runs the command per rank) runs in
tests/reliability/test_multinode.py.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch import callbacks
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_zero3
from tests.support.adapted import is_checkpoint, lightning_trainer, load_module, read_checkpoint

pytestmark = pytest.mark.slow  # "spawn": each rank imports torch and Lightning


def _strategy() -> lightning_zero3.ZeRO3Strategy:
    return lightning_zero3.ZeRO3Strategy(start_method="spawn", timeout=timedelta(seconds=60))


class _LogsLoss(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], sync_dist=True)
        return out


def test_checkpoints_written_under_the_launcher_resume_and_load(tmp_path: Path) -> None:
    """ModelCheckpoint under the spawn launcher keeps its top 2 and its last, and its state comes
    back to this process; `fit(ckpt_path=...)` resumes from the last in a new launch, whose whole
    weights come back to this process; the best loads in this process, where no process group
    exists."""

    def checkpoints(directory: str) -> callbacks.ModelCheckpoint:
        return callbacks.ModelCheckpoint(
            dirpath=tmp_path / directory, monitor="train_loss", save_top_k=2, save_last=True
        )

    first = checkpoints("first")
    lightning_trainer(_strategy(), tmp_path, max_epochs=3, limit_train_batches=2, callbacks=[first]).fit(_LogsLoss())
    kept = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert len(kept) == 3 and "last.ckpt" in kept and first.best_model_path
    assert all(is_checkpoint(tmp_path / "first" / name, "zero3") for name in kept)
    steps = {name: read_checkpoint(tmp_path / "first" / name)["global_step"] for name in kept}
    # Lightning 2.6 writes last.ckpt only with a top-k save (ModelCheckpoint.on_train_epoch_end),
    # and BoringModel's data is random: the newest top-k save, at step 6 or 4.
    assert steps["last.ckpt"] == max(step for name, step in steps.items() if name != "last.ckpt") in (4, 6)

    second = checkpoints("second")
    resumed = lightning_trainer(_strategy(), tmp_path, max_epochs=4, limit_train_batches=2, callbacks=[second])
    module = _LogsLoss()
    resumed.fit(module, ckpt_path=str(tmp_path / "first" / "last.ckpt"))
    last = read_checkpoint(tmp_path / "second" / "last.ckpt")
    assert last["global_step"] == 8
    # The launcher handed rank 0's whole weights back to this process: those of the last step.
    handed_back = module.state_dict()
    assert handed_back.keys() == last["state_dict"].keys()
    assert all(torch.equal(handed_back[name], value) for name, value in last["state_dict"].items())
    assert load_module(_LogsLoss, first.best_model_path).layer.weight.shape == (2, 32)


def _fabric_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step * world_size + rank))


def _fabric_run(fabric: L.Fabric, directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _fabric_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    losses = []
    for step in range(3):
        loss = model(_batch(step, fabric.global_rank, fabric.world_size)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    fabric.save(os.path.join(directory, "state"), {"model": model, "optimizer": optimizer, "step": 3})
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(os.path.join(directory, "state"), state)
    return {"losses": losses, "step": state["step"], "world_size": fabric.world_size}


def _one_process_losses(world_size: int) -> list[float]:
    torch.manual_seed(0)
    model = _fabric_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = model(torch.cat([_batch(step, rank, world_size) for rank in range(world_size)])).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fabric_launch_trains_saves_and_loads_like_one_process(tmp_path: Path) -> None:
    """`fabric.launch(fn)` with the spawn launcher: the losses of one process on the global batch,
    a save and load in the launched processes, and rank 0's return value back in this process."""
    strategy = lightning_zero3.ZeRO3FabricStrategy(start_method="spawn", timeout=timedelta(seconds=60))
    result = L.Fabric(strategy=strategy, accelerator="cpu", devices=2).launch(_fabric_run, str(tmp_path))
    assert result["world_size"] == 2 and result["step"] == 3
    assert max(abs(a - b) for a, b in zip(result["losses"], _one_process_losses(2))) < 1e-5
