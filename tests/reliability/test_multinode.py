"""Multi-node launches on one machine: separate torchrun invocations per "node" and processes
started with SLURM's environment variables. Each rank must train exactly like one process on
the global batch, and a rank that dies or never arrives must fail the others quickly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tests.support.lit import LitMLP, max_difference, reference_fit

pytestmark = pytest.mark.slow  # each node is a separate Python process that imports torch and Lightning

JOB = str(Path(__file__).parents[1] / "jobs" / "train_mlp.py")
ROOT = str(Path(__file__).parents[2])
TOL = 1e-5
LAUNCH_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_RANK", "NODE_RANK", "RANK"))}
    env.pop("WORLD_SIZE", None)
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    return env


def _wait(procs: list[subprocess.Popen], timeout_s: float = LAUNCH_TIMEOUT_S) -> list[tuple[int, str]]:
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


def _check_parity(out: Path, world_size: int, environment: str) -> None:
    torch.manual_seed(0)
    reference = LitMLP()
    losses = reference_fit(reference, epochs=1)
    for rank in range(world_size):
        result = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert result["global_rank"] == rank and result["world_size"] == world_size
        assert result["environment"] == environment
        assert max(abs(a - b) for a, b in zip(result["losses"], losses)) < TOL
        assert max_difference(result["state"], reference.state_dict()) < TOL


def _torchrun_node(node_rank: int, nnodes: int, nproc: int, port: int, out: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node_rank}",
        "--master-addr=127.0.0.1", f"--master-port={port}",
        JOB, "--out", str(out), "--num-nodes", str(nnodes), "--devices", str(nproc),
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("nproc_per_node", [1, 2])
def test_two_torchrun_nodes_train_like_one_process(tmp_path: Path, nproc_per_node: int) -> None:
    port = _free_port()
    procs = [_torchrun_node(node, 2, nproc_per_node, port, tmp_path) for node in (0, 1)]
    for code, output in _wait(procs):
        assert code == 0, output[-3000:]
    _check_parity(tmp_path, 2 * nproc_per_node, "TorchElasticEnvironment")


def _lightning_node(node_rank: int, port: int, out: Path) -> subprocess.Popen:
    """One "node" started by hand; Lightning's own launcher starts its second process."""
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node_rank))
    cmd = [sys.executable, JOB, "--out", str(out), "--num-nodes", "2", "--devices", "2"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_lightning_launcher_on_each_of_two_nodes_trains_like_one_process(tmp_path: Path) -> None:
    port = _free_port()
    procs = [_lightning_node(node, port, tmp_path) for node in (0, 1)]
    for code, output in _wait(procs):
        assert code == 0, output[-3000:]
    _check_parity(tmp_path, 4, "LightningEnvironment")


def _slurm_task(rank: int, ntasks: int, port: int, out: Path, *extra: str, timeout: float = 60) -> subprocess.Popen:
    env = _env(
        SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE="1", SLURM_NNODES=str(ntasks),
        SLURM_PROCID=str(rank), SLURM_LOCALID="0", SLURM_NODEID=str(rank),
        SLURM_JOB_NAME="zero3-test", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    cmd = [sys.executable, JOB, "--out", str(out), "--num-nodes", str(ntasks), "--timeout", str(timeout), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


class FinishedJob(NamedTuple):
    out: Path  # what its ranks wrote
    exits: list[tuple[int, str]]  # each rank's exit code and output


def slurm_job(out: Path, *extra: str) -> FinishedJob:
    """Two SLURM tasks of tests/jobs/train_mlp.py (`extra`: its flags), run to the end."""
    port = _free_port()
    return FinishedJob(out, _wait([_slurm_task(rank, 2, port, out, *extra) for rank in range(2)]))


def test_slurm_environment_two_nodes_train_like_one_process(slurm_job_saving_inside_fit: FinishedJob) -> None:
    """The job of tests/conftest.py `slurm_job_saving_inside_fit` (tests/reliability/test_clean_exit.py
    checks its exits too): its save inside fit leaves training as it was."""
    for code, output in slurm_job_saving_inside_fit.exits:
        assert code == 0, output[-3000:]
    _check_parity(slurm_job_saving_inside_fit.out, 2, "SLURMEnvironment")


def test_rank_that_never_arrives_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    ((code, output),) = _wait([_slurm_task(0, 2, _free_port(), tmp_path, timeout=5)], timeout_s=120)
    assert code != 0
    assert "ranks did not all join" in output, output[-3000:]
    assert time.monotonic() - start < 60


def test_rank_that_dies_mid_training_fails_the_others_with_a_clear_message(tmp_path: Path) -> None:
    port = _free_port()
    start = time.monotonic()
    die = ("--die-rank", "1", "--die-step", "1")
    procs = [_slurm_task(rank, 2, port, tmp_path, *die, timeout=20) for rank in range(2)]
    (code0, output0), (code1, _) = _wait(procs, timeout_s=150)
    assert code1 == 17  # the rank we killed
    assert code0 != 0
    assert "rank 0" in output0 and ("failed" in output0 or "timed out" in output0.lower()), output0[-3000:]
    assert time.monotonic() - start < 120
