"""Multi-node launches on one machine: separate torchrun invocations per "node" and processes
started with SLURM's environment variables. Each rank must train exactly like one process on
the global batch, and a rank that dies or never arrives must fail the others quickly."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.lit import LitMLP, max_difference, reference_fit
from tests.support.processes import TRAIN_MLP, FinishedJob, free_port, job_env, slurm_task, wait_all

pytestmark = pytest.mark.slow  # each node is a separate Python process that imports torch and Lightning

TOL = 1e-5


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
        TRAIN_MLP, "--out", str(out), "--num-nodes", str(nnodes), "--devices", str(nproc),
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("nproc_per_node", [1, 2])
def test_two_torchrun_nodes_train_like_one_process(tmp_path: Path, nproc_per_node: int) -> None:
    port = free_port()
    procs = [_torchrun_node(node, 2, nproc_per_node, port, tmp_path) for node in (0, 1)]
    for code, output in wait_all(procs):
        assert code == 0, output[-3000:]
    _check_parity(tmp_path, 2 * nproc_per_node, "TorchElasticEnvironment")


def _lightning_node(node_rank: int, port: int, out: Path) -> subprocess.Popen:
    """One "node" started by hand; Lightning's own launcher starts its second process."""
    env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node_rank))
    cmd = [sys.executable, TRAIN_MLP, "--out", str(out), "--num-nodes", "2", "--devices", "2"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_lightning_launcher_on_each_of_two_nodes_trains_like_one_process(tmp_path: Path) -> None:
    port = free_port()
    procs = [_lightning_node(node, port, tmp_path) for node in (0, 1)]
    for code, output in wait_all(procs):
        assert code == 0, output[-3000:]
    _check_parity(tmp_path, 4, "LightningEnvironment")


def test_slurm_environment_two_nodes_train_like_one_process(slurm_job_saving_inside_fit: FinishedJob) -> None:
    """The job of tests/conftest.py `slurm_job_saving_inside_fit` (tests/reliability/test_clean_exit.py
    checks its exits too): its save inside fit leaves training as it was."""
    for code, output in slurm_job_saving_inside_fit.exits:
        assert code == 0, output[-3000:]
    _check_parity(slurm_job_saving_inside_fit.out, 2, "SLURMEnvironment")


def test_rank_that_never_arrives_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    ((code, output),) = wait_all([slurm_task(0, 2, free_port(), tmp_path, timeout=5)], timeout_s=120)
    assert code != 0
    assert "ranks did not all join" in output, output[-3000:]
    assert time.monotonic() - start < 60


def test_rank_that_dies_mid_training_fails_the_others_with_a_clear_message(tmp_path: Path) -> None:
    port = free_port()
    start = time.monotonic()
    die = ("--die-rank", "1", "--die-step", "1")
    procs = [slurm_task(rank, 2, port, tmp_path, *die, timeout=20) for rank in range(2)]
    (code0, output0), (code1, _) = wait_all(procs, timeout_s=150)
    assert code1 == 17  # the rank we killed
    assert code0 != 0
    assert "rank 0" in output0 and ("failed" in output0 or "timed out" in output0.lower()), output0[-3000:]
    assert time.monotonic() - start < 120
