"""What the strategy measures reaches the user's logger (issue 29.3): `ShardingStatsMonitor`
logs each optimizer step's bytes per collective next to the formula's, the All-Gather wait, the
peak of units whole and this process's memory to the Trainer's loggers, as Lightning's
`DeviceStatsMonitor` logs device statistics; Fabric logs the same dict with `fabric.log_dict`."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_zero3 import ShardingStatsMonitor
from tests.support.adapted import launched, lightning_trainer
from tests.support.fabric_helpers import fabric
from tests.support.ranks import run_ranks


class _Blocks(BoringModel):
    """BoringModel with two repeated blocks, so that the step gathers units besides the root."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 2))


def _rows(path: Path) -> list[dict[str, float]]:
    with path.open() as file:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(file)]


def _check_step(row: dict[str, float], *, formula: bool = True) -> None:
    for kind in ("all_gather", "reduce_scatter"):
        assert row[f"zero3/{kind}_bytes"] > 0 and row[f"zero3/{kind}_bytes_formula"] > 0
        assert row[f"zero3/{kind}_bytes"] == row[f"zero3/{kind}_bytes_formula"] or not formula
    assert row["zero3/gather_wait_s"] >= 0
    assert row["zero3/peak_units_alive"] >= 1
    assert row["zero3/rss_anon_bytes"] > 2**20  # CPU: no CUDA figure
    assert "zero3/cuda_max_memory_allocated_bytes" not in row


def test_the_monitor_logs_every_optimizer_step_to_a_csv_logger(tmp_path: Path) -> None:
    """6 batches, 2 per optimizer step: 3 rows, at steps 0, 1, 2 (as `self.log`'s), with the step's
    measured bytes next to the formula's (equal from the second: in the first, the first micro-batch, with no order
    recorded yet, gathers the last unit again in backward, which the formula leaves out)."""
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = lightning_trainer(
        launched("zero3"), tmp_path, max_steps=3, accumulate_grad_batches=2, limit_train_batches=6,
        limit_val_batches=0, logger=logger, callbacks=[ShardingStatsMonitor()],
    )  # fmt: skip
    trainer.fit(_Blocks())
    rows = [row for row in _rows(tmp_path / "run" / "version_0" / "metrics.csv") if "zero3/all_gather_bytes" in row]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        _check_step(row, formula=row["step"] > 0)


class _LogsItsLoss(_Blocks):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = super().training_step(batch, batch_idx)
        self.log("train_loss", output["loss"])
        return output


def test_the_figures_of_a_step_land_at_the_step_of_the_users_own_logged_loss(tmp_path: Path) -> None:
    """As with Lightning's `DeviceStatsMonitor`: the figures of a step are logged at the step
    Lightning logs that step's `self.log("train_loss", ...)` at (a plot of both in TensorBoard
    lines up; the figures used to come one step late, at `global_step`)."""
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = lightning_trainer(
        launched("zero3"), tmp_path, max_steps=3, limit_val_batches=0, log_every_n_steps=1,
        logger=logger, callbacks=[ShardingStatsMonitor()],
    )  # fmt: skip
    trainer.fit(_LogsItsLoss())
    rows = _rows(tmp_path / "run" / "version_0" / "metrics.csv")
    assert [row["step"] for row in rows if "train_loss" in row] == [0, 1, 2]
    assert [row["step"] for row in rows if "zero3/all_gather_bytes" in row] == [0, 1, 2]


def test_the_monitor_needs_a_logger_and_the_zero3_strategy(tmp_path: Path) -> None:
    monitor = ShardingStatsMonitor()
    without_logger = pl.Trainer(strategy="zero3", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(MisconfigurationException, match="logger=False"):
        monitor.setup(without_logger, BoringModel(), "fit")
    ddp = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=CSVLogger(tmp_path))
    with pytest.raises(MisconfigurationException, match="strategy='zero3'"):
        monitor.setup(ddp, BoringModel(), "fit")


def _fabric_logs(rank: int, world_size: int, root: str) -> None:
    from lightning.fabric.loggers import CSVLogger as FabricCSVLogger

    f = fabric(rank, world_size, loggers=FabricCSVLogger(root, name="run", version=0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
    model, optimizer = f.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):
        f.backward(model(torch.randn(4, 8)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        f.log_dict(f.strategy.step_metrics(model), step=step)
    f.loggers[0].finalize("success")


def test_fabric_logs_the_step_metrics_with_log_dict(tmp_path: Path) -> Any:
    run_ranks(_fabric_logs, 2, str(tmp_path))
    rows = _rows(tmp_path / "run" / "version_0" / "metrics.csv")
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        _check_step(row)
