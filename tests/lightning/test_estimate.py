"""`python -m lightning_zero3 estimate` / `estimate(...)` predict what a run then holds and sends:
model-state bytes per rank within 5% of the storages really alive after a step (shards, their
gradients, AdamW's state), and the payload of each collective per step within 5% of what the
engine counted, at 2 and 3 ranks (3: uneven shards with padding), with bf16 gathers too."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from lightning_zero3.__main__ import main
from lightning_zero3.engine import ShardedModel, ShardingConfig
from lightning_zero3.tools.estimate import OPTIONS, add_arguments, estimate
from tests.support.ranks import run_ranks


class _Net(nn.Module):
    """A root with two layers and five blocks: units of 66k elements, root 18k."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(5))
        self.out = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.out(x)


def _alive_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (shards share one row per unit)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _run(rank: int, world_size: int, param_dtype: str | None, reshard: bool | int, quantize: bool | str,
         shard_size: int | None) -> dict[str, int]:  # fmt: skip
    torch.manual_seed(0)
    model = _Net()
    sharded = ShardedModel(model, param_dtype=param_dtype, reshard_after_forward=reshard,
                           quantize_weights=quantize is True, quantize_gradients=quantize, shard_size=shard_size)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):  # the second step runs with the recorded order, as every later one
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=param_dtype is not None):
            model(torch.randn(4, 64)).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        sharded.stats.end_step()
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return {
        "parameters": _alive_bytes(params),
        "gradients": _alive_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_states": _alive_bytes(states),
        **{kind: counted.payload_bytes for kind, counted in sharded.stats.shard_group.last_step.items()},
        "all_gather_in_groups": sum(c.payload_bytes for c in sharded.stats.slice_groups.last_step.values())
        if sharded.stats.slice_groups is not None else 0,
        "all_gather_across_groups": sharded.stats.across_groups.last_step["all_gather"].payload_bytes
        if sharded.stats.across_groups is not None and "all_gather" in sharded.stats.across_groups.last_step else 0,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "param_dtype", "reshard", "quantize", "shard_size"),
    [(2, None, True, False, None), (3, None, True, False, None), (2, "bf16", True, False, None),
     (2, "bf16", False, False, None), (4, None, 2, False, None), (3, None, True, True, None),
     (4, None, True, "int4", 2)],
)  # fmt: skip
def test_estimate_matches_the_model_state_alive_and_the_bytes_counted(world_size, param_dtype, reshard, quantize,
                                                                      shard_size):  # fmt: skip
    """With quantize=True both quantize_weights and quantize_gradients: the packed rows (int8 and
    one scale a block); "int4": the gradients only, across shard groups too."""
    config = ShardingConfig(param_dtype=param_dtype, reshard_after_forward=reshard, quantize_weights=quantize is True,
                            quantize_gradients=quantize, shard_size=shard_size)  # fmt: skip
    with torch.device("meta"):
        predicted = estimate(_Net(), world_size=world_size, config=config)
    kinds = ["parameters", "gradients", "optimizer_states", "all_gather", "reduce_scatter", "all_gather_in_groups",
             "all_gather_across_groups"]  # fmt: skip
    for measured in run_ranks(_run, world_size, param_dtype, reshard, quantize, shard_size):
        for kind in kinds:
            expected = getattr(predicted, kind)
            assert abs(measured[kind] - expected) <= 0.05 * expected, (kind, measured[kind], expected)
        assert (measured["all_gather_in_groups"] > 0) == (reshard == 2), measured
        assert (measured["all_gather_across_groups"] > 0) == (shard_size is not None), measured


def test_the_command_prints_per_rank_memory_and_traffic(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7e9", "--units", "32", "--world-size", "8", "--param-dtype", "bf16"]) == 0
    table = capsys.readouterr().out
    assert "model state, between steps            13.04 GiB" in table  # 16 bytes x 7e9 / 8
    assert "All-Gather payload / step             25.67 GiB" in table  # 2 bytes x (2 x 7e9 - one block)


def test_the_command_takes_a_model_by_import_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tests.lightning.test_estimate:_Net", "--world-size", "2"]) == 0
    assert "parameters (shards)" in capsys.readouterr().out


def test_the_command_refuses_a_model_and_a_count_together(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tests.lightning.test_estimate:_Net", "--params", "1e6", "--world-size", "2"]) == 2
    assert "either a model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--params", "1e6", "--units", "2", "--world-size", "0"], "--world-size must be at least 1"),
        (["--params", "10", "--units", "32", "--world-size", "2"], "must be at least --units"),
    ],
)
def test_the_command_refuses_counts_that_make_no_model(argv: list[str], expected: str, capsys) -> None:
    assert main(["estimate", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_the_command_takes_reshard_after_forward(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--params", "7e9", "--units", "32", "--world-size", "8", "--reshard-after-forward"]
    assert main([*argv, "false"]) == 0
    assert "All-Gather payload / step             26.08 GiB" in capsys.readouterr().out  # 4 bytes x 7e9, once
    assert main([*argv, "2"]) == 0
    assert "All-Gather in groups of 2 / step      25.26 GiB" in capsys.readouterr().out  # backward's, but the ends
    assert main([*argv, "3"]) == 2
    assert "must divide the shard group of 8 ranks" in capsys.readouterr().err


def _run_offloaded_and_unsynced(rank: int, world_size: int, directory: str) -> dict[str, int]:
    """Host offload with the optimizer state on disk, 2 micro-batches the first without sync: the
    model state in host memory and in file maps after a step, and the sums alive while owed."""
    torch.manual_seed(0)
    model = _Net()
    sharded = ShardedModel(model, offload="host", offload_dir=directory)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        with sharded.no_sync():
            model(torch.randn(4, 64)).square().mean().backward()
        sums = sum(summed.total.nbytes for summed in sharded._gradient_sync._summed.values())
        model(torch.randn(4, 64)).square().mean().backward()
        sharded.stats.end_step()
        optimizer.step()
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return {
        "host": _alive_bytes(params) + _alive_bytes([p.grad for p in params if p.grad is not None]),
        "disk": _alive_bytes(states),
        "sums": sums,
        **{kind: counted.payload_bytes for kind, counted in sharded.stats.shard_group.last_step.items()},
    }


def test_estimate_matches_offloaded_state_and_unsynced_sums(tmp_path) -> None:
    """`offloaded_to_host` (shards and gradients), `offloaded_to_disk` (AdamW state in file maps),
    `unsynced_sums` and the payload per optimizer step of 2 micro-batches with one sync, within 5%."""
    config = ShardingConfig(offload="host", offload_dir=str(tmp_path))
    with torch.device("meta"):
        predicted = estimate(_Net(), world_size=2, config=config, micro_batches=2, no_sync=True)
    expected = {
        "host": predicted.offloaded_to_host, "disk": predicted.offloaded_to_disk, "sums": predicted.unsynced_sums,
        "all_gather": predicted.all_gather, "reduce_scatter": predicted.reduce_scatter,
    }  # fmt: skip
    assert expected["host"] == predicted.parameters + predicted.gradients
    assert expected["disk"] == predicted.optimizer_states
    for measured in run_ranks(_run_offloaded_and_unsynced, 2, str(tmp_path)):
        for kind, value in expected.items():
            assert abs(measured[kind] - value) <= 0.05 * value, (kind, measured[kind], value)


def test_the_command_takes_the_engine_options_by_their_config_names_defaults_and_checks(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given = parser.parse_args(["--params", "1e6", "--world-size", "2"])
    defaults = ShardingConfig()
    assert {name: getattr(given, name) for name in OPTIONS} == {name: getattr(defaults, name) for name in OPTIONS}
    assert main(["estimate", "--params", "1e6", "--world-size", "2", "--prefetch", "-1"]) == 2
    assert "ShardingConfig(prefetch=...) must be an int >= 0" in capsys.readouterr().err
