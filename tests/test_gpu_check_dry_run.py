"""benchmarks/gpu_check.py runs its code paths on CPU (`--dry-run`), so the script a GPU session
relies on cannot rot between GPU sessions. It runs as the command a user types, in its own
process: its Lightning checks join a process group in the process that runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_passes_in_its_dry_run_on_cpu(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--fast", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    lines = re.findall(r"^(PASS|FAIL)  (\(\w\))", done.stdout, flags=re.M)
    assert {check for _, check in lines} == {"(a)", "(b)", "(c)", "(d)"}, printed
    assert all(verdict == "PASS" for verdict, _ in lines), printed
    assert (tmp_path / "gpu_check_trace.json").stat().st_size > 0
