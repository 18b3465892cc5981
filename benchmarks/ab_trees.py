"""A/B of one backend between two source trees (e.g. a commit before an engine change and the
change itself): the tree A run, then the tree B run, round after round, each a fresh set of rank
processes importing `lightning_zero3` from its own tree. Per round, the ratio B / A of the median
wall time and of the median CPU time per step (slowest rank, as in compare.py); then the median
of those ratios. CPU time is nearly blind to other processes on the machine; alternating the
trees spreads drift in load over both.

    git worktree add --detach /tmp/base <commit>      # tree A
    python benchmarks/ab_trees.py --a /tmp/base --b . --backend engine-p1 --rounds 4
    python benchmarks/ab_trees.py --a . --b . --backend engine-p1 --backend-b engine-p1-shm   # two options

Both trees must have `benchmarks/compare.py` (the run itself is compare.py's `run_once`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_CHILD = """
import json, sys
from benchmarks.compare import parse_args, run_once
from benchmarks.model import make_batches, window_length
from benchmarks.summary import summarize_run
backend, size = sys.argv[1], sys.argv[2]
devices, steps, warmup, batch = (int(x) for x in sys.argv[3:7])
args = parse_args(["--size", size, "--devices", str(devices), "--batch-size", str(batch), "--backends", backend])
windows, vocab = make_batches(
    block_size=window_length(size), batch_size=batch, world_size=devices, steps=warmup + steps, seed=args.seed
)
ranks = run_once(args, backend, devices, windows, vocab, warmup=warmup)
s = summarize_run(backend, ranks, warmup=warmup)
print("AB_RESULT " + json.dumps({k: s[k] for k in ("median_s", "median_cpu_s", "step_times_s", "cpu_s", "losses",
      "peak_rss_bytes", "model_state_bytes")}))
"""


def run_tree(tree: Path, args: argparse.Namespace, backend: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", _CHILD, backend, args.size, str(args.devices), str(args.steps),
           str(args.warmup), str(args.batch_size)]  # fmt: skip
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("AB_RESULT "):
            return json.loads(line[len("AB_RESULT ") :])
    raise SystemExit(f"run in {tree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="tree A (the baseline)")
    p.add_argument("--b", type=Path, required=True, help="tree B (the change)")
    p.add_argument("--backend", default="engine-p1")
    p.add_argument("--backend-b", help="tree B's backend, when it differs (e.g. an option: engine-p1-shm)")
    p.add_argument("--size", default="20m")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--json", type=Path, help="write every run here")
    args = p.parse_args(argv)
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    runs: list[dict[str, Any]] = []
    wall, cpu = [], []
    for k in range(args.rounds):
        pair = {}
        for name, tree in trees.items():
            load = os.getloadavg()[0]
            pair[name] = run_tree(tree, args, args.backend_b if name == "B" and args.backend_b else args.backend)
            runs.append({"round": k, "tree": name, "load": load, **pair[name]})
            print(f"round {k + 1} {name}: wall {pair[name]['median_s']:.3f} s, CPU {pair[name]['median_cpu_s']:.3f} s "
                  f"(load {load:.2f})", flush=True)  # fmt: skip
        wall.append(pair["B"]["median_s"] / pair["A"]["median_s"])
        cpu.append(pair["B"]["median_cpu_s"] / pair["A"]["median_cpu_s"])
        same = pair["A"]["losses"] == pair["B"]["losses"]
        print(f"round {k + 1}: B/A wall {wall[-1]:.3f}, CPU {cpu[-1]:.3f}; losses equal: {same}", flush=True)
    med = {name: statistics.median(r["median_cpu_s"] for r in runs if r["tree"] == name) for name in trees}
    rss = {name: max(r["peak_rss_bytes"] for r in runs if r["tree"] == name) / 2**20 for name in trees}
    print(f"B/A over {args.rounds} rounds ({args.backend}, {args.size}): "
          f"median wall ratio {statistics.median(wall):.3f} "
          f"(rounds {', '.join(f'{x:.3f}' for x in wall)}), median CPU ratio {statistics.median(cpu):.3f} "
          f"(rounds {', '.join(f'{x:.3f}' for x in cpu)}); CPU s/step A {med['A']:.3f}, B {med['B']:.3f}; "
          f"peak RSS MiB A {rss['A']:.0f}, B {rss['B']:.0f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                         "time": time.time()}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
