"""Many short 2-rank fit + save jobs (tests/jobs/short_save.py), `--parallel` at a time, cycling
through Trainer and Fabric, synchronous and background saves: how many exit other than 0 or
abort at exit (issue 30.1). Rank 1 is a child of rank 0 under Lightning's launcher, so its
abort does not change the exit code the driver sees: its "terminate called" on the shared
stderr, and a missing rank{r}.done, count too. Also counted: jobs where a rank still had gloo's
worker threads when its Python finalized (the abort's precondition, seen even when the race is won).

    python benchmarks/exit_stress.py --jobs 200 --parallel 2
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = Path(__file__).resolve().parent.parent / "tests" / "jobs" / "short_save.py"
VARIANTS = [
    [*api, *save, *keep]
    for api, save, keep in itertools.product(
        (["--api", "trainer"], ["--api", "fabric"]), ([], ["--async-save"]), ([], ["--keep-gathered"])
    )
]
ABORT_MARKS = ("terminate called", "Aborted", "core dumped", "Fatal Python error")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=None, help="stop starting jobs after this long")
    args = parser.parse_args()
    start, done, bad, threads_left = time.monotonic(), 0, [], []
    with tempfile.TemporaryDirectory() as tmp:
        running: list[tuple[int, list[str], Path, subprocess.Popen[str]]] = []
        next_job = 0
        while next_job < args.jobs or running:
            out_of_time = args.minutes is not None and time.monotonic() - start > args.minutes * 60
            while len(running) < args.parallel and next_job < args.jobs and not out_of_time:
                out = Path(tmp) / f"job{next_job}"
                out.mkdir()
                extra = VARIANTS[next_job % len(VARIANTS)]
                command = [sys.executable, str(JOB), "--out", str(out), *extra]
                proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                running.append((next_job, extra, out, proc))
                next_job += 1
            if out_of_time and next_job < args.jobs and not running:
                break
            job, extra, out, proc = running.pop(0)
            output, _ = proc.communicate(timeout=600)
            done += 1
            marks = [m for m in ABORT_MARKS if m in output]
            missing = [r for r in (0, 1) if not (out / f"rank{r}.done").exists()]
            if any("gloo" in f.read_text() for f in out.glob("threads-*.txt")):
                threads_left.append(job)  # gloo's workers alive as Python finalized: the abort's precondition
            if proc.returncode != 0 or marks or missing:
                bad.append(job)
                print(f"job {job} {' '.join(extra)}: exit {proc.returncode}, marks {marks}, no done file from ranks "
                      f"{missing}\n{output[-2000:]}", flush=True)  # fmt: skip
    print(f"{done} jobs, {len(bad)} exited other than 0 or aborted ({time.monotonic() - start:.0f} s): {bad}")
    print(f"{len(threads_left)} jobs had gloo worker threads alive as a rank's Python finalized: {threads_left}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
