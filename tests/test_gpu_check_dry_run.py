"""benchmarks/gpu_check.py runs its code on CPU (`--dry-run`), so the script a GPU session relies
on cannot rot between GPU sessions. It runs as the command a user types, in its own process: its
Lightning and Fabric checks join a process group in the process that runs them. On CPU the checks
of collectives at world size 1, losses, checkpoints, validate and predict give verdicts; those only
a GPU can show print RAN."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_every_section_on_cpu_and_nothing_fails() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--fast"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    lines = re.findall(r"^(PASS|FAIL|INFO|RAN) +\((\w)\) (.*)$", done.stdout, flags=re.M)
    assert {check for _, check, _ in lines} == set("abcdef"), printed
    assert not [line for line in lines if line[0] == "FAIL"], printed
    passed = {check for verdict, check, _ in lines if verdict == "PASS"}
    assert passed == {"a", "d", "e", "f"}, printed  # the sections whose properties CPU can show
    assert any("collectives in 4 steps" in text for verdict, check, text in lines if check == "a"), printed
