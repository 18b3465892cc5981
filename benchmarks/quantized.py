"""What `quantize_weights` / `quantize_gradients` cost and gain, on examples/train_gpt.py.

    python benchmarks/quantized.py run --steps 300 --size tiny --link 1e6 --link-steps 30
    python benchmarks/quantized.py link 125e6 examples/train_gpt.py --size tiny --steps 20   # one slowed run

`run` trains the example at 2 ranks once per setting (exact, int8 weights, int8 gradients, both,
int8 weights + int4 gradients) with the same seed and data, and writes OUT/quantized.json, a
table OUT/quantized.md and docs/figures/quantized-loss.png: each step's loss against the exact
run, the final loss, the largest weight difference from the exact run, the payload the strategy
counted in the last step, and the fit time per step, on loopback and on a slowed link.

The slowed link (`link RATE`) is a stand-in for a slow network between ranks, installed by this
script only, in each rank (the launcher re-runs this command line in every rank): every
transport the engine chooses (engine/transport.py) is wrapped so that each All-Gather,
Reduce-Scatter and all-to-all occupies one link of RATE bytes per second for its ring wire bytes
((N-1)/N of the payload) after the collectives issued before it, and its wait returns no earlier
than that. The data still moves over loopback gloo, unchanged; only the waits are held back, so
prefetch and reductions in flight overlap the "transfer" with compute as they would on a real
link. Not modelled: the All-Reduces outside the transports (gradient clipping's norm, whole
parameters), a few bytes per step here.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> train_gpt.py arguments
    "exact": [],
    "int8 weights": ["--quantize-weights"],
    "int8 gradients": ["--quantize-gradients", "int8"],
    "int8 both": ["--quantize-weights", "--quantize-gradients", "int8"],
    "int8 weights, int4 gradients": ["--quantize-weights", "--quantize-gradients", "int4"],
}


class _Late:
    """A collective's work whose wait returns no earlier than `ready` (perf_counter seconds)."""

    def __init__(self, work: Any, ready: float) -> None:
        self.work, self.ready = work, ready

    def is_completed(self) -> bool:
        return (self.work is None or self.work.is_completed()) and time.perf_counter() >= self.ready

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        time.sleep(max(0.0, self.ready - time.perf_counter()))
        return True


class SlowLink:
    """A transport whose collectives take their wire bytes / `bytes_per_s`, one after another."""

    def __init__(self, inner: Any, *, world_size: int, bytes_per_s: float) -> None:
        self.inner, self.world_size, self.bytes_per_s = inner, world_size, bytes_per_s
        self.busy_until = 0.0

    def _late(self, work: Any, rows: torch.Tensor) -> _Late:
        wire = rows.numel() * rows.element_size() * (self.world_size - 1) / self.world_size
        self.busy_until = max(time.perf_counter(), self.busy_until) + wire / self.bytes_per_s
        return _Late(work, self.busy_until)

    def all_gather(self, rows: torch.Tensor) -> _Late:
        return self._late(self.inner.all_gather(rows), rows)

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor) -> _Late:
        return self._late(self.inner.reduce_scatter(output, rows), rows)

    def all_to_all(self, output: torch.Tensor, rows: torch.Tensor) -> _Late:
        return self._late(self.inner.all_to_all(output, rows), rows)


def install_slow_link(bytes_per_s: float) -> None:
    """Wrap every transport a `Comm` chooses (one rank's `Local` aside) in a `SlowLink`.
    Note: patches the private `Comm._choose` (torch 2.13, lightning_zero3 main, December 2026): a
    benchmark-side stand-in, never imported by the package; without it runs are unslowed."""
    from lightning_zero3.engine import Comm
    from lightning_zero3.engine.transport import Local

    choose = Comm._choose

    def slowed(self: Comm) -> Any:
        transport = choose(self)
        return transport if isinstance(transport, Local) else SlowLink(
            transport, world_size=self.world_size, bytes_per_s=bytes_per_s)  # fmt: skip

    Comm._choose = slowed  # type: ignore[method-assign]


def _train(setting: str, *, steps: int, out: Path, link: float | None, size: str, reuse: bool) -> dict[str, Any]:
    results = out / f"{setting.replace(' ', '_').replace(',', '')}{'-slow' if link else ''}.pt"
    example = [str(ROOT / "examples" / "train_gpt.py"), "--size", size, "--steps", str(steps), "--devices", "2",
               "--log-dir", str(out / "logs"), "--results", str(results), *SETTINGS[setting]]  # fmt: skip
    command = [sys.executable, __file__, "link", str(link), *example] if link else [sys.executable, *example]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not (reuse and results.exists()):
        subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return torch.load(results, weights_only=False)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table: dict[str, Any] = {"steps": args.steps, "size": args.size, "link_bytes_per_s": args.link, "runs": {}}
    exact: dict[str, Any] | None = None
    for setting in SETTINGS:
        row: dict[str, Any] = {}
        for link in (None, args.link):
            steps = args.steps if link is None else args.link_steps
            if link is not None and setting not in ("exact", "int8 both"):
                continue
            result = _train(setting, steps=steps, out=out, link=link, size=args.size, reuse=args.reuse)
            last = result["stats"]["last_step"]
            prefix = "" if link is None else "slow_"
            row[prefix + "s_per_step"] = result["wall_s"] / result["steps"]
            if link is None:
                exact = exact or result
                row["losses"] = result["losses"]
                row["final_loss"] = sum(result["losses"][-10:]) / 10
                row["max_weight_difference"] = max(
                    float((w - exact["weights"][k]).abs().max()) for k, w in result["weights"].items())  # fmt: skip
                row["bytes"] = {k: last.get(k, {}).get("payload_bytes", 0) for k in ("all_gather", "reduce_scatter")}
                row["formula"] = {k: result["stats"]["expected_step_bytes"].get(k, 0)
                                  for k in ("all_gather", "reduce_scatter")}  # fmt: skip
        table["runs"][setting] = row
        print(setting, {k: v for k, v in row.items() if k != "losses"}, flush=True)
    (out / "quantized.json").write_text(json.dumps(table, indent=1))
    _write_table(table, out / "quantized.md")
    _plot(table, ROOT / "docs" / "figures" / "quantized-loss.png")


def _write_table(table: dict[str, Any], path: Path) -> None:
    runs = table["runs"]
    exact = runs["exact"]
    lines = [f"train_gpt.py --size {table['size']}, 2 ranks, {table['steps']} steps; slowed link "
             f"{table['link_bytes_per_s'] / 1e6:.0f} MB/s\n",
             "| setting | final loss (mean of last 10) | vs exact | max weight diff | All-Gather B/step | "
             "Reduce-Scatter B/step | s/step loopback | s/step slowed |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in runs.items():
        ratio = {k: row["bytes"][k] / exact["bytes"][k] for k in ("all_gather", "reduce_scatter")}
        slow = f"{row['slow_s_per_step']:.3f}" if "slow_s_per_step" in row else "-"
        lines.append(
            f"| {name} | {row['final_loss']:.4f} | {100 * (row['final_loss'] / exact['final_loss'] - 1):+.2f}% | "
            f"{row['max_weight_difference']:.2e} | {row['bytes']['all_gather']:,} ({ratio['all_gather']:.3f}x) | "
            f"{row['bytes']['reduce_scatter']:,} ({ratio['reduce_scatter']:.3f}x) | {row['s_per_step']:.3f} | {slow} |"
        )
    path.write_text("\n".join(lines) + "\n")


def _plot(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = table["runs"]
    exact = runs["exact"]["losses"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    window = 10  # a running mean: one step's loss is noisy

    def smooth(values: list[float]) -> list[float]:
        return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))]  # fmt: skip

    for name, row in runs.items():
        top.plot(smooth(row["losses"]), label=name, linewidth=1)
        if name != "exact":
            diff = [100 * (q / e - 1) for q, e in zip(smooth(row["losses"]), smooth(exact))]
            bottom.plot(diff, label=name, linewidth=1)
    top.set_ylabel(f"train loss, rank 0 (mean of {window})")
    top.legend()
    bottom.axhline(0, color="grey", linewidth=0.5)
    bottom.set_ylabel("vs exact, %")
    bottom.set_xlabel("step")
    top.set_title(f"train_gpt.py --size {table['size']}, 2 CPU ranks: quantized collectives")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _run_example(script: str, arguments: list[str]) -> None:
    """The example's `main()` parsing `arguments`, while `sys.argv` stays this command line: the
    launcher re-runs `sys.argv` to start the other ranks, which must slow their links too."""
    example = runpy.run_path(script, run_name="train_gpt")
    parse_args, command_line = example["parse_args"], list(sys.argv)

    def parse_its_own() -> argparse.Namespace:
        sys.argv = [script, *arguments]
        try:
            return parse_args()
        finally:
            sys.argv = command_line

    example["main"].__globals__["parse_args"] = parse_its_own
    example["main"]()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "link":  # in each rank: slow the link, then run the example
        install_slow_link(float(sys.argv[2]))
        _run_example(sys.argv[3], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--link-steps", type=int, default=60, help="steps of the slowed runs")
    parser.add_argument("--link", type=float, default=125e6, help="bytes per second of the slowed link (1 Gbit/s)")
    parser.add_argument("--size", default="small")
    parser.add_argument("--out", default="benchmarks/results/quantized")
    parser.add_argument("--reuse", action="store_true", help="read the runs OUT already holds instead of rerunning")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
