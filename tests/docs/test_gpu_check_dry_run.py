"""benchmarks/gpu_check.py runs its code on CPU (`--dry-run`), so the script a GPU session relies
on cannot rot between GPU sessions. It runs as the command a user types, in its own process: its
Lightning and Fabric checks join a process group in the process that runs them. Every section's
code runs; collectives, losses, fp16 overflow, checkpoints, validate, predict, 2 ranks and races
(through the CPU stand-in) give verdicts; syncs and device memory, which only a GPU shows, print
RAN."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one process running every section of benchmarks/gpu_check.py

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_every_section_on_cpu_and_nothing_fails() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--fast"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    lines = re.findall(r"^(PASS|FAIL|INFO|RAN) +\((\w)\) (.*)$", done.stdout, flags=re.M)
    assert {check for _, check, _ in lines} == set("abcdefgh"), printed
    assert not [line for line in lines if line[0] == "FAIL"], printed
    passed = {check for verdict, check, _ in lines if verdict == "PASS"}
    assert passed == {"a", "d", "e", "f", "g", "h"}, printed  # the sections whose properties CPU can show
    ran = {check for verdict, check, _ in lines if verdict == "RAN"}
    assert {"b", "c", "h"} <= ran and "not applicable" not in printed and "not measured" not in printed, printed
    assert any("collectives in 4 steps" in text for verdict, check, text in lines if check == "a"), printed
    assert any("stand-in" in text for verdict, check, text in lines if verdict == "PASS"), printed
    assert any("overflow skipped True" in text for verdict, check, text in lines if verdict == "PASS"), printed
    h = [text for verdict, check, text in lines if check == "h"]  # the one-GPU section, every part of it
    for part in ("syncs in a steady step", "after gathered_for_inference()", "after full_state_dict()",
                 "hidden by prefetch=1", "staging rows", "(subprocess): exit 0"):  # fmt: skip
        assert any(part in text for text in h), printed
