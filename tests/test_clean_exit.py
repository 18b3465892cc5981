"""Short 2-rank jobs that save inside `fit`, started as users start them (one process per rank,
the strategy joining the process group), exit 0 on every rank: no collective in flight and no
process group alive when Python finalizes (gloo's worker threads abort the process then).

The suite runs one job (its save in the background, on a process group of its own); for a stress
run under load, ask for more (they run `ZERO3_EXIT_PARALLEL` at a time, every other one saving
synchronously): `ZERO3_EXIT_RUNS=40 python -m pytest -q tests/test_clean_exit.py`. Every other
multi-rank test watches for the same abort: `tests.ranks.run_ranks` fails a run whose rank
reported and then exited with a code other than 0.
"""

from __future__ import annotations

import multiprocessing.util
import os
import signal
from pathlib import Path

import pytest

from tests.ranks import RankFailure, run_ranks
from tests.test_multinode import _free_port, _slurm_task, _wait


def test_short_jobs_that_save_inside_fit_exit_cleanly_on_every_rank(tmp_path: Path) -> None:
    runs = int(os.environ.get("ZERO3_EXIT_RUNS", "1"))
    parallel = int(os.environ.get("ZERO3_EXIT_PARALLEL", "2"))
    failures: list[str] = []
    for first in range(0, runs, parallel):
        batch = []
        for run in range(first, min(first + parallel, runs)):
            out = tmp_path / f"run{run}"
            out.mkdir()
            port = _free_port()
            extra = ("--save-step", "1", *([] if run % 2 else ["--async-save"]))
            batch.append((run, [_slurm_task(rank, 2, port, out, *extra) for rank in range(2)]))
        for run, procs in batch:
            for rank, (code, output) in enumerate(_wait(procs)):
                if code != 0:
                    failures.append(f"run {run} rank {rank} exited {code}:\n{output[-1500:]}")
    assert not failures, f"{len(failures)} rank exits not 0 in {runs} runs:\n" + "\n".join(failures)


def _report_then_abort_at_exit(rank: int, world_size: int) -> int:
    # Stands in for the abort issue 22.9 saw: the rank's result has reached the parent when the
    # process dies at exit (multiprocessing runs this finalizer after the target returned and
    # after the result queue's feeder thread flushed).
    if rank == 1:
        multiprocessing.util.Finalize(None, os.kill, args=(os.getpid(), signal.SIGABRT), exitpriority=-10)
    return rank


def test_a_rank_that_reported_and_then_aborted_at_exit_fails_the_harness() -> None:
    with pytest.raises(RankFailure, match=r"--- rank 1 ---\nreported, then exited with code -6"):
        run_ranks(_report_then_abort_at_exit, 2)
