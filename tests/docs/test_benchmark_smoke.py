"""`benchmarks/compare.py --smoke` runs every backend end to end (one subprocess for the module,
~15-30 s on 2 cores; DeepSpeed's backend joins it, a few seconds more, where deepspeed is
installed) and writes a JSON in which every number is finite and ZeRO-3's losses are DDP's."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # every backend of benchmarks/compare.py, each launched

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["ddp", "fsdp2", "lightning-ddp", "zero3-p0", "zero3-p1", "zero3-p2", "engine-p1", "engine-p1-async"]


def _numbers(obj: object) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _numbers(v)]
    return []


HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("smoke")
    names = BACKENDS + (["deepspeed"] if HAVE_DEEPSPEED else [])
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--smoke", "--out", str(out)]
    cmd += ["--backends", ",".join(names)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "compare.md").read_text().startswith("Command:")
    return json.loads((out / "compare.json").read_text())


def test_benchmark_smoke_reports_every_backend(smoke: dict[str, Any]) -> None:
    result = smoke
    backends = {name: entry for name, entry in result["backends"].items() if name != "deepspeed"}
    assert list(backends) == BACKENDS
    for name, entry in backends.items():
        numbers = _numbers(entry)
        assert numbers and all(math.isfinite(x) for x in numbers), f"{name}: non-finite value in {entry}"
        assert entry["median_step_s"] > 0 and entry["tokens_per_s"] > 0, name
        assert entry["model_state_bytes"]["total"] > 0, name
        assert entry["step_bytes"], name

    ddp = backends["ddp"]["losses"]
    for name in BACKENDS[1:]:
        losses = backends[name]["losses"]
        assert len(losses) == len(ddp) == 4
        assert max(abs(a - b) for a, b in zip(losses, ddp)) < 1e-5, (name, losses, ddp)

    zero3 = backends["zero3-p1"]
    counted = {k: v["payload_bytes"] for k, v in zero3["step_bytes"].items()}
    assert counted == zero3["expected_step_bytes"]
    n, psi = result["config"]["world_size"], result["psi"]
    assert zero3["model_state_bytes"]["total"] <= 1.01 * 16 * psi / n


def test_benchmark_smoke_deepspeed_matches_ddp_and_is_counted(smoke: dict[str, Any]) -> None:
    """DeepSpeed ZeRO-3 (its defaults) trains to DDP's losses, keeps 20Ψ/N bytes of model state
    (an fp32 master partition besides the parameter partition) and, the model being gathered
    once and kept from forward to backward, moves one All-Gather and one Reduce-Scatter of Ψ
    per step, each counted once at torch.distributed."""
    pytest.importorskip("deepspeed")
    result = smoke
    n, psi = result["config"]["world_size"], result["psi"]
    ddp, deepspeed = result["backends"]["ddp"], result["backends"]["deepspeed"]

    assert max(abs(a - b) for a, b in zip(deepspeed["losses"], ddp["losses"])) < 1e-5
    partition = psi * 4 // n  # fp32 bytes of 1/N of the parameters (Ψ is even here: no padding)
    assert deepspeed["model_state_bytes"] == {
        "param": partition,
        "master": partition,
        "grad": partition,
        "optimizer": 2 * partition,
        "total": 5 * partition,
    }
    step = deepspeed["step_bytes"]
    assert step["all_gather"]["payload_bytes"] == psi * 4
    assert step["reduce_scatter"]["payload_bytes"] == psi * 4
