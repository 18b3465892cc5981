"""A LightningCLI program as a user writes one: the strategy and its options come from a YAML
config (`trainer.strategy.class_path/init_args`) and the command line. Each rank writes the
options its strategy holds to OUT/rank{global_rank}.json for the test to check."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel  # noqa: E402

import lightning_zero3  # noqa: E402, F401  # registers "zero3"


class ReportsOptions(BoringModel):
    def __init__(self, out: str = "") -> None:
        super().__init__()
        self.out = out

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        options = {**asdict(strategy.config), **asdict(strategy.lightning_options)}
        seen = {name: value if isinstance(value, (bool, int, str, type(None))) else repr(value)
                for name, value in options.items()}  # fmt: skip
        seen.update(strategy=type(strategy).__name__, world_size=self.trainer.world_size, step=self.global_step)
        with open(os.path.join(self.out, f"rank{self.global_rank}.json"), "w") as file:
            json.dump(seen, file)


if __name__ == "__main__":
    LightningCLI(ReportsOptions, BoringDataModule)
