"""Each test starts from the environment the session started with: Lightning's launcher and
`seed_everything`, run in the test process by the tests that launch as Lightning's suite does
(tests/support/adapted.py `launched`), write os.environ (PL_GLOBAL_SEED, MASTER_PORT, ...), and every rank
a later test starts would inherit it (PL_GLOBAL_SEED reseeds Lightning's ranks).

Jobs of separate processes that tests in several modules read are launched once a session here."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.processes import FinishedJob


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(scope="session")
def slurm_job_saving_inside_fit(tmp_path_factory: pytest.TempPathFactory) -> FinishedJob:
    """Two SLURM tasks training one epoch and saving in the background after step 1: it trains
    like one process (tests/reliability/test_multinode.py) and every rank exits 0
    (tests/reliability/test_clean_exit.py)."""
    from tests.support.processes import slurm_job

    return slurm_job(tmp_path_factory.mktemp("slurm_saving_inside_fit"), "--save-step", "1", "--async-save")


@pytest.fixture(scope="session")
def gpt_saved_at_2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[dict, dict]]:
    """A sharded checkpoint of TinyGPT saved by 2 ranks (tests/support/checkpoints.py
    `save_trained_gpt`) and the whole state it holds. Read it only: a test that damages a
    checkpoint or writes beside one takes `gpt_checkpoint`."""
    from tests.support.checkpoints import save_trained_gpt
    from tests.support.ranks import run_ranks

    path = tmp_path_factory.mktemp("gpt_saved_at_2") / "gpt.ckpt"
    return path, run_ranks(save_trained_gpt, 2, str(path))[0]


@pytest.fixture
def gpt_checkpoint(gpt_saved_at_2: tuple[Path, tuple[dict, dict]], tmp_path: Path) -> Path:
    """This test's own copy of `gpt_saved_at_2`'s checkpoint (~100 KB consolidated)."""
    path = tmp_path / "gpt.ckpt"
    shutil.copytree(gpt_saved_at_2[0], path)
    return path
