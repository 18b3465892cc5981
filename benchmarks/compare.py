"""Train the same GPT on the same data with PyTorch DDP, PyTorch FSDP2, Lightning DDP, Lightning
ZeRO-3 (prefetch 0, 1, 2), the ZeRO-3 engine without Lightning and, when installed, DeepSpeed ZeRO-3.

    DS_BUILD_OPS=0 pip install -e ".[bench]"            # matplotlib and deepspeed (pure Python)
    python benchmarks/compare.py                        # 2 ranks, CPU/gloo, GPT "20m" (~19M params)
    python benchmarks/compare.py --backends ddp,fsdp2,deepspeed,lightning-ddp,zero3-p1 --rounds 5 --plot
    python benchmarks/compare.py --mode scaling --plot  # model state and step time for N = 1..4
    python benchmarks/compare.py --smoke                # tiny model, 2 rounds, a few steps
    python benchmarks/compare.py --accelerator gpu --devices 2 --size 85m   # NCCL, with MFU

Runs alternate backend by backend within each round (A B C ... A B C ...) so that drift on a shared
machine hits every backend alike; figures are medians over steps and rounds, ratios medians of
per-round ratios. Each run is a fresh set of rank processes; only the steps after `--warmup` are
timed. Results: markdown on stdout and in OUT/compare.md, all in OUT/compare.json, --plot OUT/*.png.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_zero3` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning
import torch

from benchmarks import report
from benchmarks.backends import BACKENDS, DEFAULT_BACKENDS, RunSpec, rank_main
from benchmarks.deepspeed_backend import DEEPSPEED_BACKENDS, deepspeed_missing
from benchmarks.launch import run_ranks
from benchmarks.model import SIZES, make_batches, window_length
from benchmarks.summary import check_targets, peak_tflops_for, summarize_backends, summarize_run

ROOT = Path(__file__).resolve().parent.parent
SCALING_BACKENDS = ["fsdp2", "deepspeed", "zero3-p1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add = p.add_argument
    add("--mode", choices=["compare", "scaling"], default="compare",
        help="compare backends at --devices ranks, or model state and step time for N = --scaling-ranks")
    add("--size", choices=list(SIZES), default="20m", help="GPT preset (default 20m: ~19M params)")
    add("--devices", type=int, default=2, help="ranks for --mode compare (default 2)")
    add("--accelerator", choices=["cpu", "gpu"], default="cpu", help="cpu (gloo) or gpu (NCCL)")
    add("--backends", default=",".join(DEFAULT_BACKENDS),
        help=f"comma-separated, from {', '.join(BACKENDS)} (default: all but DeepSpeed's and the reshard pairs)")
    add("--rounds", type=int, default=3, help="rounds of alternating runs (default 3)")
    add("--steps", type=int, default=4, help="timed steps per run (default 4)")
    add("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    add("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    add("--accumulate", type=int, default=1, metavar="K", help="K micro-batches per step, gradient sync off but on "
        "the last (DDP no_sync, FSDP2, ShardedModel.no_sync); ddp, fsdp2, engine-* only")
    add("--scaling-ranks", default="1,2,3,4", help="N values for --mode scaling (default 1,2,3,4)")
    add("--scaling-backends", default=",".join(SCALING_BACKENDS))
    add("--scaling-steps", type=int, default=3, help="timed steps per scaling run (default 3)")
    add("--scaling-warmup", type=int, default=1, help="untimed steps before them (default 1)")
    add("--peak-tflops", type=float, help="device peak for MFU, if the GPU is not in the built-in table")
    add("--replot", type=Path, metavar="JSON", help="only redo a result JSON's markdown and charts (in its folder)")
    add("--smoke", action="store_true", help="tiny model, 2 rounds, 3 steps: a check that it all runs")
    add("--plot", action="store_true", help="write PNG charts (needs matplotlib: pip install -e '.[bench]')")
    add("--out", type=Path, help="output folder (default benchmarks/results, or benchmarks/results/smoke)")
    p.set_defaults(lr=3e-4, seed=0, scaling_rounds=1)  # fixed: AdamW's lr, the seed of weights and batches
    args = p.parse_args(argv)
    if args.smoke:  # a tiny model and few steps; --rounds still applies when given
        args.size, args.steps, args.warmup, args.batch_size = "smoke", 3, 1, 2
        args.rounds = 2 if args.rounds == p.get_default("rounds") else args.rounds
        args.scaling_ranks, args.scaling_steps = "1,2", 2
    args.out = args.out or ROOT / "benchmarks" / "results" / ("smoke" if args.smoke else "")
    args.backends, args.scaling_backends = _available(args.backends), _available(args.scaling_backends)
    kinds = {b.split("-")[0] for b in args.backends}
    if args.accumulate > 1 and (args.batch_size % args.accumulate or kinds - {"ddp", "fsdp2", "engine"}):
        p.error(f"--accumulate {args.accumulate} needs a --batch-size it divides and --backends ddp, fsdp2, engine-*")
    return args


def _available(text: str) -> list[str]:
    """The backends named in `text`, less DeepSpeed's where DeepSpeed cannot be imported (one line says so)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    why = deepspeed_missing() if any(n in DEEPSPEED_BACKENDS for n in names) else None
    if why is None:
        return names
    skipped = [n for n in names if n in DEEPSPEED_BACKENDS]
    print(f"skipping {', '.join(skipped)}: {why}", file=sys.stderr)
    return [n for n in names if n not in DEEPSPEED_BACKENDS]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    """The machine, and the commit and a hash of the package's sources as they are (others edit them)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted((ROOT / "lightning_zero3").rglob("*.py"))))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    except OSError:
        head = ""
    info: dict[str, Any] = {
        "cores": _cores(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "load_average_start": _load(),
        "git_head": head.strip(),
        "lightning_zero3_sha256": digest.hexdigest()[:16],
    }
    if args.accelerator == "gpu":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def run_rounds(
    args: argparse.Namespace, backends: list[str], world_size: int, *, rounds: int, steps: int, warmup: int
) -> list[dict[str, Any]]:
    """`rounds` x every backend, alternating, each a fresh launch of `world_size` ranks."""
    if args.accelerator == "gpu" and torch.cuda.device_count() < world_size:
        raise SystemExit(f"--accelerator gpu needs {world_size} GPUs, found {torch.cuda.device_count()}")
    windows, vocab = make_batches(block_size=window_length(args.size), batch_size=args.batch_size,
                                  world_size=world_size, steps=warmup + steps, seed=args.seed)  # fmt: skip
    threads = max(1, _cores() // world_size)
    dist_backend = "nccl" if args.accelerator == "gpu" else "gloo"
    runs = []
    for k in range(rounds):
        for name in backends:
            load, started = _load(), time.perf_counter()
            spec = RunSpec(name, args.size, vocab, windows, warmup, args.seed, args.lr, args.accelerator,
                           args.accumulate)  # fmt: skip
            ranks = run_ranks(rank_main, world_size, spec, backend=dist_backend, threads=threads)
            summary = summarize_run(name, ranks, warmup=warmup)
            wall = time.perf_counter() - started
            runs.append({"backend": name, "round": k, "world_size": world_size, "load_average": load, "wall_s": wall,
                         "psi": ranks[0]["psi"], "summary": summary})  # fmt: skip
            print(f"[N={world_size} round {k + 1}/{rounds}] {name:<14} median step {summary['median_s']:.3f} s "
                  f"(load {load[0]:.2f})", file=sys.stderr, flush=True)  # fmt: skip
    return runs


def compare(args: argparse.Namespace, result: dict[str, Any]) -> None:
    n = args.devices
    runs = run_rounds(args, args.backends, n, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    psi, device_name = runs[0]["psi"], runs[0]["summary"].get("device_name")
    peak = peak_tflops_for(device_name, args.peak_tflops) if args.accelerator == "gpu" else None
    tokens = n * args.batch_size * window_length(args.size)
    backends = summarize_backends(runs, psi=psi, world_size=n, tokens_per_step=tokens, peak_tflops=peak)
    result.update(psi=psi, runs=runs, backends=backends, targets=check_targets(backends, psi=psi, world_size=n))
    if peak:
        result["peak_tflops_per_device"] = peak


def scaling(args: argparse.Namespace, result: dict[str, Any], save: Callable[[], Any]) -> None:
    """Model state, peak RSS and step time for each N; the files are rewritten after every N, so
    a long run (the 124m model) that is stopped keeps what it measured."""
    result["scaling"] = rows = []
    for n in [int(x) for x in args.scaling_ranks.split(",")]:
        runs = run_rounds(args, args.scaling_backends, n, rounds=args.scaling_rounds, steps=args.scaling_steps,
                          warmup=args.scaling_warmup)  # fmt: skip
        result["psi"] = psi = runs[0]["psi"]
        for name in args.scaling_backends:
            mine = [r["summary"] for r in runs if r["backend"] == name]
            times = [t for s in mine for t in s["step_times_s"]]
            rows.append({
                "backend": name,
                "world_size": n,
                "model_state_bytes": mine[0]["model_state_bytes"]["total"],
                "sixteen_psi_over_n": 16 * psi / n,
                "median_step_s": sorted(times)[len(times) // 2],
                "median_cpu_s": statistics.median(c for s in mine for c in s["cpu_s"]),
                "peak_rss_bytes": max(s["peak_rss_bytes"] for s in mine),
                "model_state": mine[0]["model_state_bytes"],
                "load_average_1min": max(r["load_average"][0] for r in runs if r["backend"] == name),
                "losses": mine[0]["losses"],
                "oversubscribed": n > _cores(),
                "threads_per_rank": max(1, _cores() // n),
            })  # fmt: skip
        save()


def markdown(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    head = (
        f"Command: `{result['command']}`  \nDate: {result['date']}; {m['cores']} cores ({m['cpu']}), "
        f"torch {m['torch']}, lightning {m.get('lightning')}; load average (1, 5, 15 min) {m['load_average_start']} "
        f"at start, {m['load_average_end']} at end; code: commit {m['git_head']}, lightning_zero3 sources sha256 "
        f"{m['lightning_zero3_sha256']}.  \nGPT `{cfg['size']}`: Ψ = {result['psi']:,} parameters; {cfg['batch_size']} "
        f"x {cfg.get('window', cfg['block_size'])} tokens per rank per step; fp32, AdamW."
    )
    lines = [head]
    if "backends" in result:
        lines[0] += (f" Comparison: {cfg['rounds']} rounds x {cfg['steps']} timed steps (after {cfg['warmup']} "
                     f"warm-up) per backend; {cfg['threads_per_rank']} torch thread(s) per rank.")  # fmt: skip
    if "scaling" in result:
        lines[0] += (f" Scaling: {cfg.get('scaling_rounds', 1)} round(s) x {cfg.get('scaling_steps', 3)} timed steps "
                     f"(after {cfg.get('scaling_warmup', 1)} warm-up) per backend and N; torch threads per rank = "
                     "max(1, cores // N).")  # fmt: skip
    lines.append("")
    if "backends" in result:
        lines += [f"### Step time, {cfg['world_size']} ranks ({cfg['accelerator']})", "",
                  report.time_table(result["backends"]), "", "### Memory, communication per step, loss", "",
                  report.memory_table(result["backends"]), ""]  # fmt: skip
        if result["targets"]:
            lines += ["### Targets (zero3 = Lightning, prefetch=1)", "", report.targets_list(result["targets"]), ""]
    if "scaling" in result:
        lines += ["### Scaling: model state per rank vs N", "", report.scaling_table(result["scaling"]), ""]
        if any(s["oversubscribed"] for s in result["scaling"]):
            lines += [f"N > {m['cores']} ranks run oversubscribed on {m['cores']} cores: their step times are not "
                      "a throughput measurement; the bytes are exact.", ""]  # fmt: skip
    return "\n".join(lines)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (dict, list)):
        return {k: _finite(v) for k, v in obj.items()} if isinstance(obj, dict) else [_finite(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.replot:
        result = json.loads(args.replot.read_text())
        args.replot.with_suffix(".md").write_text(markdown(result) + "\n")
        for path in report.plot(result, args.replot.parent):
            print(f"wrote {path}")
        return result
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    config = {k: getattr(args, k) for k in ("size", "accelerator", "rounds", "steps", "warmup", "batch_size", "lr",
                                            "seed", "scaling_rounds", "scaling_steps", "scaling_warmup")}  # fmt: skip
    config.update(SIZES[args.size], window=window_length(args.size), world_size=args.devices,
                  threads_per_rank=max(1, _cores() // args.devices))  # fmt: skip
    result: dict[str, Any] = {
        "command": f"python benchmarks/compare.py {command}".strip(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(args),
        "config": config,
    }

    def save() -> str:
        result["machine"]["load_average_end"] = _load()
        text = markdown(result)
        (args.out / f"{args.mode}.md").write_text(text + "\n")
        (args.out / f"{args.mode}.json").write_text(json.dumps(_finite(result), indent=1) + "\n")
        return text

    if args.mode == "compare":
        compare(args, result)
    else:
        scaling(args, result, save)
    print(save())
    print(f"wrote {args.out / (args.mode + '.md')} and {args.out / (args.mode + '.json')}")
    for path in report.plot(result, args.out) if args.plot else []:
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
