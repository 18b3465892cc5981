"""Jobs of separate Python processes started as users start theirs (a command per node,
SLURM's variables, `python script.py` re-run by Lightning's launcher): the environment they
get, a free port, and each process's exit code and output once all have finished."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = str(Path(__file__).parents[2])  # the repository, on each job's PYTHONPATH
JOBS = Path(__file__).parents[1] / "jobs"
TRAIN_MLP = str(JOBS / "train_mlp.py")
LAUNCH_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launcher variables a test's own launch left."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK", "RANK"))}
    env.pop("WORLD_SIZE", None)
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    return env


def wait_all(procs: list[subprocess.Popen], timeout_s: float = LAUNCH_TIMEOUT_S) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout_s
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a launched process did not finish within {timeout_s} s") from None
        results.append((p.returncode, out.decode(errors="replace")))
    return results


def slurm_task(rank: int, ntasks: int, port: int, out: Path, *extra: str, timeout: float = 60) -> subprocess.Popen:
    """One task of tests/jobs/train_mlp.py with the variables SLURM sets, one task per node."""
    env = job_env(
        SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE="1", SLURM_NNODES=str(ntasks),
        SLURM_PROCID=str(rank), SLURM_LOCALID="0", SLURM_NODEID=str(rank),
        SLURM_JOB_NAME="zero3-test", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    cmd = [sys.executable, TRAIN_MLP, "--out", str(out), "--num-nodes", str(ntasks), "--timeout", str(timeout), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


class FinishedJob(NamedTuple):
    out: Path  # what its ranks wrote
    exits: list[tuple[int, str]]  # each rank's exit code and output


def slurm_job(out: Path, *extra: str) -> FinishedJob:
    """Two SLURM tasks of tests/jobs/train_mlp.py (`extra`: its flags), run to the end."""
    port = free_port()
    return FinishedJob(out, wait_all([slurm_task(rank, 2, port, out, *extra) for rank in range(2)]))
