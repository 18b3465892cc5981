"""Train the same GPT on the same data with PyTorch DDP, PyTorch FSDP2, Lightning DDP,
Lightning ZeRO-3 (prefetch 0, 1, 2), the ZeRO-3 engine without Lightning and, when installed,
DeepSpeed ZeRO-3; compare them.

    DS_BUILD_OPS=0 pip install -e ".[bench]"            # matplotlib and deepspeed (pure Python)

    python benchmarks/compare.py                        # 2 ranks, CPU/gloo, GPT "20m" (~19M params)
    python benchmarks/compare.py --size 5m --plot       # ~5M params, with PNG charts
    python benchmarks/compare.py --mode scaling --plot  # model state and step time for N = 1..4
    python benchmarks/compare.py --backends ddp,fsdp2,deepspeed,lightning-ddp,zero3-p1 --rounds 5
    python benchmarks/compare.py --mode scaling --size 124m --batch-size 1 --scaling-steps 2 --plot
    python benchmarks/compare.py --backends fsdp2,zero3-p1,fsdp2-no-reshard,zero3-p1-no-reshard  # reshard False too
    python benchmarks/compare.py --smoke                # tiny model, 2 rounds, a few steps
    python benchmarks/compare.py --accelerator gpu --devices 2 --size 85m   # NCCL, with MFU

Runs alternate backend by backend within each round (A B C ... A B C ...) so that drift on a
shared machine hits every backend alike; the figures are medians over steps and rounds, and
ratios are medians of per-round ratios. Each run is a fresh set of rank processes; only the
training steps after `--warmup` are timed. Results: a markdown table on stdout and in
OUT/compare.md, everything in OUT/compare.json, and with --plot OUT/*.png.
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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--mode",
        choices=["compare", "scaling"],
        default="compare",
        help="compare backends at --devices ranks, or model state and step time for N = --scaling-ranks",
    )
    p.add_argument("--size", choices=list(SIZES), default="20m", help="GPT preset (default 20m: ~19M params)")
    p.add_argument("--devices", type=int, default=2, help="ranks for --mode compare (default 2)")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="cpu (gloo) or gpu (NCCL)")
    p.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"comma-separated, from {', '.join(BACKENDS)} (default: all but DeepSpeed's)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of alternating runs (default 3)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--accumulate", type=int, default=1, metavar="K", help="K micro-batches per step, gradient sync off "
                   "but on the last (DDP no_sync, FSDP2, ShardedModel.no_sync); ddp, fsdp2, engine-* only")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores // ranks, >= 1)")
    p.add_argument("--scaling-ranks", default="1,2,3,4", help="N values for --mode scaling (default 1,2,3,4)")
    p.add_argument("--scaling-backends", default=",".join(SCALING_BACKENDS))
    p.add_argument("--scaling-rounds", type=int, default=1)
    p.add_argument("--scaling-steps", type=int, default=3, help="timed steps per scaling run (default 3)")
    p.add_argument("--scaling-warmup", type=int, default=1, help="untimed steps before them (default 1)")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU, if the GPU is not in the built-in table")
    p.add_argument(
        "--replot", type=Path, metavar="JSON", help="only redraw the charts of a result JSON (into its folder)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 rounds, 3 steps: a check that it all runs")
    p.add_argument("--plot", action="store_true", help="write PNG charts (needs matplotlib: pip install -e '.[bench]')")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results, or benchmarks/results/smoke)")
    args = p.parse_args(argv)
    if args.smoke:  # a tiny model and few steps; --rounds still applies when given
        args.size, args.steps, args.warmup, args.batch_size = "smoke", 3, 1, 2
        args.rounds = 2 if args.rounds == p.get_default("rounds") else args.rounds
        args.scaling_ranks, args.scaling_steps = "1,2", 2
    args.out = args.out or ROOT / "benchmarks" / "results" / ("smoke" if args.smoke else "")
    args.backends = _available(_names(args.backends))
    args.scaling_backends = _available(_names(args.scaling_backends))
    kinds = {b.split("-")[0] for b in args.backends}
    if args.accumulate > 1 and (args.batch_size % args.accumulate or kinds - {"ddp", "fsdp2", "engine"}):
        p.error(f"--accumulate {args.accumulate} needs a --batch-size it divides and --backends ddp, fsdp2, engine-*")
    return args


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    return names


def _available(names: list[str]) -> list[str]:
    """`names` less the DeepSpeed backends where DeepSpeed cannot be imported (one line says so)."""
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


def code_version() -> dict[str, str]:
    """The commit and a hash of the package's sources as they are (other people edit them)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "lightning_zero3").rglob("*.py")):
        digest.update(path.read_bytes())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    except OSError:
        head = ""
    return {"git_head": head.strip(), "lightning_zero3_sha256": digest.hexdigest()[:16]}


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": _cores(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_start": _load(),
        **code_version(),
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:
        pass
    if args.accelerator == "gpu":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


# ---- runs --------------------------------------------------------------------------------


def run_once(
    args: argparse.Namespace,
    backend: str,
    world_size: int,
    windows: torch.Tensor,
    vocab: int,
    *,
    warmup: int,
) -> list[dict[str, Any]]:
    if args.accelerator == "gpu" and torch.cuda.device_count() < world_size:
        raise SystemExit(f"--accelerator gpu needs {world_size} GPUs, found {torch.cuda.device_count()}")
    spec = RunSpec(
        backend=backend,
        size=args.size,
        vocab_size=vocab,
        windows=windows,
        warmup=warmup,
        seed=args.seed,
        lr=args.lr,
        accelerator=args.accelerator,
        accumulate=args.accumulate,
    )
    threads = args.threads or max(1, _cores() // world_size)
    dist_backend = "nccl" if args.accelerator == "gpu" else "gloo"
    return run_ranks(rank_main, world_size, spec, backend=dist_backend, threads=threads)


def run_rounds(
    args: argparse.Namespace, backends: list[str], world_size: int, *, rounds: int, steps: int, warmup: int
) -> list[dict[str, Any]]:
    block = window_length(args.size)
    windows, vocab = make_batches(
        block_size=block, batch_size=args.batch_size, world_size=world_size, steps=warmup + steps, seed=args.seed
    )
    runs = []
    for k in range(rounds):
        for name in backends:
            load = _load()
            started = time.perf_counter()
            ranks = run_once(args, name, world_size, windows, vocab, warmup=warmup)
            summary = summarize_run(name, ranks, warmup=warmup)
            runs.append(
                {
                    "backend": name,
                    "round": k,
                    "world_size": world_size,
                    "load_average": load,
                    "wall_s": time.perf_counter() - started,
                    "psi": ranks[0]["psi"],
                    "summary": summary,
                }
            )
            print(
                f"[N={world_size} round {k + 1}/{rounds}] {name:<14} median step {summary['median_s']:.3f} s "
                f"(load {load[0]:.2f})",
                file=sys.stderr,
                flush=True,
            )
    return runs


def compare(args: argparse.Namespace, result: dict[str, Any]) -> None:
    n = args.devices
    runs = run_rounds(args, args.backends, n, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    psi = runs[0]["psi"]
    device_name = runs[0]["summary"].get("device_name")
    peak = peak_tflops_for(device_name, args.peak_tflops) if args.accelerator == "gpu" else None
    tokens = n * args.batch_size * window_length(args.size)
    backends = summarize_backends(runs, psi=psi, world_size=n, tokens_per_step=tokens, peak_tflops=peak)
    result.update(psi=psi, runs=runs, backends=backends, targets=check_targets(backends, psi=psi, world_size=n))
    if peak:
        result["peak_tflops_per_device"] = peak


def scaling(args: argparse.Namespace, result: dict[str, Any], save: Callable[[], Any]) -> None:
    """Model state, peak RSS and step time for each N; the files are rewritten after every N, so
    a long run (the 124m model) that is stopped keeps what it measured."""
    rows: list[dict[str, Any]] = []
    result["scaling"] = rows
    for n in [int(x) for x in args.scaling_ranks.split(",")]:
        runs = run_rounds(
            args,
            args.scaling_backends,
            n,
            rounds=args.scaling_rounds,
            steps=args.scaling_steps,
            warmup=args.scaling_warmup,
        )
        psi = runs[0]["psi"]
        result["psi"] = psi
        for name in args.scaling_backends:
            mine = [r["summary"] for r in runs if r["backend"] == name]
            loads = [r["load_average"][0] for r in runs if r["backend"] == name]
            times = [t for s in mine for t in s["step_times_s"]]
            rows.append(
                {
                    "backend": name,
                    "world_size": n,
                    "model_state_bytes": mine[0]["model_state_bytes"]["total"],
                    "sixteen_psi_over_n": 16 * psi / n,
                    "median_step_s": sorted(times)[len(times) // 2],
                    "median_cpu_s": statistics.median(c for s in mine for c in s["cpu_s"]),
                    "peak_rss_bytes": max(s["peak_rss_bytes"] for s in mine),
                    "model_state": mine[0]["model_state_bytes"],
                    "load_average_1min": max(loads),
                    "losses": mine[0]["losses"],
                    "oversubscribed": n > _cores(),
                    "threads_per_rank": args.threads or max(1, _cores() // n),
                }
            )
        save()


# ---- output ------------------------------------------------------------------------------


def markdown(args: argparse.Namespace, result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [
        f"Command: `{result['command']}`  ",
        f"Date: {result['date']}; {m['cores']} cores ({m['cpu']}), torch {m['torch']}, lightning {m.get('lightning')}; "
        f"load average (1, 5, 15 min) {m['load_average_start']} at start, {m['load_average_end']} at end; "
        f"code: commit {m['git_head']}, lightning_zero3 sources sha256 {m['lightning_zero3_sha256']}.  ",
        f"GPT `{cfg['size']}`: Ψ = {result['psi']:,} parameters; "
        f"{cfg['batch_size']} x {cfg.get('window', cfg['block_size'])} tokens "
        f"per rank per step; fp32, AdamW.",
    ]
    if "backends" in result:
        lines[-1] += (
            f" Comparison: {cfg['rounds']} rounds x {cfg['steps']} timed steps (after {cfg['warmup']} warm-up) per "
            f"backend; {cfg['threads_per_rank']} torch thread(s) per rank."
        )
    if "scaling" in result:
        lines[-1] += (
            f" Scaling: {cfg.get('scaling_rounds', 1)} round(s) x {cfg.get('scaling_steps', 3)} timed steps (after "
            f"{cfg.get('scaling_warmup', 1)} warm-up) per backend and N; torch threads per rank = max(1, cores // N)."
        )
    lines.append("")
    if "backends" in result:
        n = cfg["world_size"]
        lines += [
            f"### Step time, {n} ranks ({cfg['accelerator']})",
            "",
            report.time_table(result["backends"]),
            "",
            "### Memory, communication per step, loss",
            "",
            report.memory_table(result["backends"]),
            "",
        ]
        if result["targets"]:
            lines += ["### Targets (zero3 = Lightning, prefetch=1)", "", report.targets_list(result["targets"]), ""]
    if "scaling" in result:
        lines += ["### Scaling: model state per rank vs N", "", report.scaling_table(result["scaling"]), ""]
        if any(s["oversubscribed"] for s in result["scaling"]):
            lines += [
                f"N > {m['cores']} ranks run oversubscribed on {m['cores']} cores: their step times are not "
                "a throughput measurement; the bytes are exact.",
                "",
            ]
    return "\n".join(lines)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.replot:
        result = json.loads(args.replot.read_text())
        args.replot.with_suffix(".md").write_text(markdown(args, result) + "\n")
        for path in report.plot(result, args.replot.parent):
            print(f"wrote {path}")
        return result
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/compare.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    result: dict[str, Any] = {
        "command": command.strip(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(args),
        "config": {
            "size": args.size,
            **SIZES[args.size],
            "window": window_length(args.size),
            "world_size": args.devices,
            "accelerator": args.accelerator,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "threads_per_rank": args.threads or max(1, _cores() // args.devices),
            "scaling_rounds": args.scaling_rounds,
            "scaling_steps": args.scaling_steps,
            "scaling_warmup": args.scaling_warmup,
        },
    }
    stem = args.mode

    def save() -> str:
        result["machine"]["load_average_end"] = _load()
        text = markdown(args, result)
        (args.out / f"{stem}.md").write_text(text + "\n")
        (args.out / f"{stem}.json").write_text(json.dumps(_finite(result), indent=1) + "\n")
        return text

    if args.mode == "compare":
        compare(args, result)
    else:
        scaling(args, result, save)
    text = save()
    print(text)
    print(f"wrote {args.out / (stem + '.md')} and {args.out / (stem + '.json')}")
    if args.plot:
        for path in report.plot(result, args.out):
            print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
