"""Short 2-rank jobs that save inside `fit`, started as users start them (one process per rank,
the strategy joining the process group), exit 0 on every rank: no collective in flight and no
process group alive when Python finalizes (gloo's worker threads abort the process then).

The suite runs one job (its save in the background, on a process group of its own); for a stress
run under load, ask for more (they run `ZERO3_EXIT_PARALLEL` at a time, every other one saving
synchronously): `ZERO3_EXIT_RUNS=40 python -m pytest -q tests/test_clean_exit.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

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
