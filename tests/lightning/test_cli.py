"""LightningCLI sees every option of the strategies (issue 29.2): a YAML config with
`class_path: lightning_zero3.ZeRO3Strategy` and `init_args`, options on the command line, and
`--print_config`, as for Lightning's own FSDPStrategy and DeepSpeedStrategy."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lightning_zero3 import ZeRO3FabricStrategy, ZeRO3Strategy
from lightning_zero3.common.options import LightningOptions
from lightning_zero3.engine import ShardingConfig
from tests.support.processes import JOBS, ROOT, job_env

JOB = str(JOBS / "cli.py")
OPTIONS = [f for config in (ShardingConfig, LightningOptions) for f in fields(config)]
HINTS = {**get_type_hints(ShardingConfig), **get_type_hints(LightningOptions)}  # the fields' types

CONFIG = """\
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 2
  limit_val_batches: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: lightning_zero3.ZeRO3Strategy
    init_args:
      prefetch: 2
      wrap_policy: [torch.nn.Linear]
      reduce_dtype: bf16
      rank_checks: 3
      reshard_after_forward: false
      state_dict_type: full
      timeout: "0:01:00"
"""


@pytest.mark.parametrize("strategy", [ZeRO3Strategy, ZeRO3FabricStrategy])
def test_every_option_is_a_keyword_of_the_strategy_with_its_fields_type_and_default(strategy: type) -> None:
    """What static checkers, IDEs and LightningCLI read: a field added to `ShardingConfig` or
    `LightningOptions` without its keyword in both strategies' `__init__` fails here, saying what to add."""
    parameters = inspect.signature(strategy.__init__, eval_str=True).parameters
    for option in OPTIONS:
        given_as = option.metadata.get("given_as", HINTS[option.name])  # e.g. a dtype or its name
        written = str(given_as) if "given_as" in option.metadata else option.type  # as in the source
        keyword = parameters.get(option.name)
        assert (
            keyword is not None and keyword.kind is inspect.Parameter.KEYWORD_ONLY
            and keyword.default == option.default and keyword.annotation == given_as
        ), (
            f"{strategy.__name__}.__init__ ({inspect.getsourcefile(strategy)}) must take the option {option.name} as "
            f"its dataclass field has it: add the line `        {option.name}: {written} = {option.default!r},` "
            f"there in the fields' order, and the same in the other strategy; got {keyword or 'no such keyword'}."
        )  # fmt: skip
    options = [name for name in parameters if name in HINTS]
    assert options == [o.name for o in OPTIONS]  # in the dataclasses' order, as `--print_config` shows them
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


@pytest.mark.slow
def test_lightning_cli_yaml_and_command_line_options_reach_the_strategy_on_two_ranks(tmp_path: Path) -> None:
    """`python cli.py fit --config config.yaml --trainer.strategy.prefetch=3` trains on 2 ranks
    started by Lightning's launcher (the script re-run per rank); each rank's strategy holds the
    YAML's options, typed as the dataclasses hold them, with the command line's prefetch."""
    config, run = tmp_path / "config.yaml", tmp_path / "run"  # the run directory gets a copy of the config
    config.write_text(CONFIG)
    cmd = [sys.executable, JOB, "fit", "--config", str(config), "--trainer.strategy.prefetch=3",
           f"--model.out={tmp_path}", f"--trainer.default_root_dir={run}"]  # fmt: skip
    done = subprocess.run(cmd, env=job_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["strategy"] == "ZeRO3Strategy" and seen["world_size"] == 2 and seen["step"] == 2
        assert seen["prefetch"] == 3  # the command line over the YAML
        assert seen["wrap_policy"] == repr({torch.nn.Linear})
        assert seen["reduce_dtype"] == repr(torch.bfloat16)
        assert seen["rank_checks"] == 3 and seen["reshard_after_forward"] is False
        assert seen["state_dict_type"] == "full" and seen["timeout"] == "datetime.timedelta(seconds=60)"
        assert seen["persistence_threshold"] == 0 and seen["start_method"] == "popen"  # defaults


def test_print_config_lists_every_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--print_config` in this process: LightningCLI prints the config and exits, as it does in
    the user's program (the 2-rank test above runs one as its own process)."""
    (tmp_path / "config.yaml").write_text(CONFIG)
    args = ["fit", "--config", str(tmp_path / "config.yaml"), "--print_config"]
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # pytest's own arguments are not the CLI's
    with pytest.raises(SystemExit) as exited:
        LightningCLI(BoringModel, BoringDataModule, args=args)
    assert exited.value.code in (0, None)
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_zero3.ZeRO3Strategy"
    printed = strategy["init_args"]
    assert [name for name in printed if name in {o.name for o in OPTIONS}] == [o.name for o in OPTIONS]
    assert printed["prefetch"] == 2 and printed["persistence_threshold"] == 0 and printed["offload"] is None
    assert printed["timeout"] == "0:01:00" and printed["accumulate_unsharded"] is False


def test_fabric_strategy_options_parse_from_a_config() -> None:
    """Fabric has no CLI of its own; jsonargparse, which LightningCLI and users' own CLIs use,
    builds `ZeRO3FabricStrategy` from a config with its options typed."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ZeRO3FabricStrategy, "strategy")
    config = parser.parse_object(
        {"strategy": {"prefetch": 0, "param_dtype": "fp16", "rank_checks": "first_step", "reshard_after_forward": 2,
                      "offload": "host", "start_method": "spawn", "timeout": "0:00:30"}}
    )  # fmt: skip
    strategy = parser.instantiate_classes(config).strategy
    assert isinstance(strategy, ZeRO3FabricStrategy)
    assert strategy.config.prefetch == 0 and strategy.config.param_dtype is torch.float16
    assert strategy.config.rank_checks == "first_step" and strategy.config.reshard_after_forward == 2
    assert strategy.config.offload == "host" and strategy.lightning_options.start_method == "spawn"
    assert strategy.lightning_options.timeout.total_seconds() == 30
