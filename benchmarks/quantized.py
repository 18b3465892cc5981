"""What `quantize_weights` / `quantize_gradients` cost and gain, on examples/train_gpt.py.

    python benchmarks/quantized.py run --steps 300 --size tiny --link 1e6 --link-steps 40
    python benchmarks/quantized.py run --steps 300 --size tiny --link 1e6 --link-steps 40 --devices 4 \
        --out benchmarks/results/quantized-4
    python benchmarks/quantized.py link 1e6 examples/train_gpt.py --size tiny --steps 20   # one slowed run
    python benchmarks/quantized.py blocks        # the error against the block size (docs/accounting.md)
    python benchmarks/quantized.py feedback examples/train_gpt.py --size tiny --steps 300 --results R.pt \
        --quantize-weights --quantize-gradients int4    # one run with error feedback (docs/accounting.md)

`run` trains the example at `--devices` ranks (default 2) once per setting (exact, int8 weights, int8 gradients, both,
int8 weights + int4 gradients, and for reference bf16 gradient reductions) with the same seed
and data, and writes OUT/quantized.json, a table OUT/quantized.md and
docs/figures/quantized-loss-{N}ranks.png: each step's loss against the exact run, the final loss, the
weights' difference from the exact run's and the payload the strategy counted in the last step;
then, for exact and int8 both, the median time from one training step to the next in shorter
runs on loopback and on a slowed link.

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
    "bf16 reduce (not quantized)": ["--reduce-dtype", "bf16"],  # a lossy reference users already accept
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
    """Wrap every transport a `Comm` of two or more ranks chooses in a `SlowLink`.
    [Note: the slow link's patch] patches the private `Comm._choose` (torch 2.13, December 2026): a
    benchmark-side stand-in, never imported by the package; without it runs are unslowed."""
    from lightning_zero3.engine import Comm

    choose = Comm._choose

    def slowed(self: Comm) -> Any:
        transport = choose(self)
        return transport if self.world_size == 1 else SlowLink(
            transport, world_size=self.world_size, bytes_per_s=bytes_per_s)  # fmt: skip

    Comm._choose = slowed  # type: ignore[method-assign]


def install_error_feedback() -> None:
    """Error feedback on the quantized Reduce-Scatter (LoCo's residual), for the measurement in
    docs/accounting.md only: each rank adds to the rows it sends what their last quantized send
    lost, keyed by the reduction's `what`. [Note: the error feedback patch] wraps the private
    `Comm.reduce_scatter` and `Comm.codec` (torch 2.13, December 2026); a benchmark-side
    experiment, never imported by the package."""
    from lightning_zero3.engine import Comm

    residuals: dict[str, torch.Tensor] = {}
    reduce_scatter, codec, current = Comm.reduce_scatter, Comm.codec, [""]

    class WithResidual:
        def __init__(self, inner: Any, what: str) -> None:
            self.inner, self.what = inner, what

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def quantize(self, rows: torch.Tensor, packed: torch.Tensor) -> None:
            data = rows[:, : self.inner.data]  # the gradients; the tail (check codes) travels as it is
            residual = residuals.setdefault(self.what, torch.zeros_like(data))
            data.add_(residual)
            self.inner.quantize(rows, packed)
            decoded = torch.empty_like(rows)
            self.inner.dequantize(packed, decoded)
            torch.sub(data, decoded[:, : self.inner.data], out=residual)

    def named(self: Comm, output: torch.Tensor, rows: torch.Tensor, *, what: str, **options: Any) -> Any:
        current[0] = what
        try:
            return reduce_scatter(self, output, rows, what=what, **options)
        finally:
            current[0] = ""

    def with_residual(self: Comm, kind: str, **options: Any) -> Any:
        inner = codec(self, kind, **options)
        return WithResidual(inner, current[0]) if inner is not None and current[0] else inner

    Comm.reduce_scatter = named  # type: ignore[method-assign]
    Comm.codec = with_residual  # type: ignore[method-assign]


def _train(
    setting: str, *, steps: int, out: Path, link: float | None, size: str, devices: int, reuse: bool
) -> dict[str, Any]:
    name = "".join(c for c in setting.replace(" ", "_") if c.isalnum() or c == "_")
    name += f"-{steps}{'-slow' if link else ''}"
    results = out / f"{name}.pt"
    example = [str(ROOT / "examples" / "train_gpt.py"), "--size", size, "--steps", str(steps),
               "--devices", str(devices), "--log-dir", str(out / "logs"), "--results", str(results),
               *SETTINGS[setting]]  # fmt: skip
    command = [sys.executable, __file__, "link", str(link), *example] if link else [sys.executable, *example]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not (reuse and results.exists()):
        subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return torch.load(results, weights_only=False)


def run(args: argparse.Namespace) -> None:
    """The long runs (losses, weights, bytes) for every setting; then short runs of "exact" and
    "int8 both" on loopback and on the slowed link for the step times."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table: dict[str, Any] = {"steps": args.steps, "size": args.size, "devices": args.devices,
                             "link_bytes_per_s": args.link, "timed_steps": args.link_steps, "runs": {}}  # fmt: skip
    train = lambda setting, steps, link: _train(setting, steps=steps, out=out, link=link, size=args.size,
                                                devices=args.devices, reuse=args.reuse)  # fmt: skip
    exact = train("exact", args.steps, None)
    for setting in SETTINGS:
        result = train(setting, args.steps, None)
        last, formula = result["stats"]["last_step"], result["stats"]["expected_step_bytes"]
        row: dict[str, Any] = {
            "losses": result["losses"],
            "final_loss": sum(result["losses"][-10:]) / 10,
            "max_weight_difference": max(float((w - exact["weights"][k]).abs().max())
                                         for k, w in result["weights"].items()),
            "relative_weight_difference": (
                sum(float((w - exact["weights"][k]).square().sum()) for k, w in result["weights"].items())
                / sum(float(w.square().sum()) for w in exact["weights"].values())) ** 0.5,
            "bytes": {k: last.get(k, {}).get("payload_bytes", 0) for k in ("all_gather", "reduce_scatter")},
            "formula": {k: formula.get(k, 0) for k in ("all_gather", "reduce_scatter")},
        }  # fmt: skip
        if setting in ("exact", "int8 both"):
            for prefix, link in (("", None), ("slow_", args.link)):
                clock = train(setting, args.link_steps, link)["clock"]
                gaps = sorted(b - a for a, b in zip(clock, clock[1:]))
                row[prefix + "s_per_step"] = gaps[len(gaps) // 2]  # the median: start-up, validation, spikes out
        table["runs"][setting] = row
        print(setting, {k: v for k, v in row.items() if k != "losses"}, flush=True)
    (out / "quantized.json").write_text(json.dumps(table, indent=1))
    _write_table(table, out / "quantized.md")
    _plot(table, ROOT / "docs" / "figures" / f"quantized-loss-{args.devices}ranks.png")


def _write_table(table: dict[str, Any], path: Path) -> None:
    runs = table["runs"]
    exact = runs["exact"]
    lines = [f"train_gpt.py --size {table['size']}, {table['devices']} ranks, {table['steps']} steps; step times: "
             f"median over {table['timed_steps']} steps, loopback and a link slowed to "
             f"{table['link_bytes_per_s'] / 1e6:g} MB/s\n",
             "| setting | final loss (mean of last 10) | vs exact | weights vs exact: max, relative RMS | "
             "All-Gather B/step | Reduce-Scatter B/step | s/step loopback | s/step slowed |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in runs.items():
        ratio = {k: row["bytes"][k] / exact["bytes"][k] for k in ("all_gather", "reduce_scatter")}
        fast, slow = (f"{row[k]:.3f}" if k in row else "-" for k in ("s_per_step", "slow_s_per_step"))
        lines.append(
            f"| {name} | {row['final_loss']:.4f} | {100 * (row['final_loss'] / exact['final_loss'] - 1):+.2f}% | "
            f"{row['max_weight_difference']:.3f}, {row['relative_weight_difference']:.3f} | "
            f"{row['bytes']['all_gather']:,} ({ratio['all_gather']:.3f}x) | "
            f"{row['bytes']['reduce_scatter']:,} ({ratio['reduce_scatter']:.3f}x) | {fast} | {slow} |"
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

    for i, (name, row) in enumerate(runs.items()):
        top.plot(smooth(row["losses"]), label=name, linewidth=1, color=f"C{i}")
        if name != "exact":
            diff = [100 * (q / e - 1) for q, e in zip(smooth(row["losses"]), smooth(exact))]
            bottom.plot(diff, label=name, linewidth=1, color=f"C{i}")
    top.set_ylabel(f"train loss, rank 0 (mean of {window})")
    top.legend()
    bottom.axhline(0, color="grey", linewidth=0.5)
    bottom.set_ylabel("vs exact, %")
    bottom.set_xlabel("step")
    top.set_title(f"train_gpt.py --size {table['size']}, {table['devices']} CPU ranks: quantized collectives")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def blocks() -> None:
    """Print the relative RMS error of one quantize-decode round trip against the block size, on
    the example GPT's (--size small) weights and gradients after 29 AdamW steps (docs/accounting.md)."""
    import torch.nn.functional as F

    from lightning_zero3.engine import RowCodec

    sys.path.insert(0, str(ROOT / "examples"))
    import train_gpt as example

    torch.manual_seed(0)
    tokenizer = example.CharTokenizer(example.load_text())
    config = example.GPTConfig(vocab_size=len(tokenizer.chars), **example.SIZES["small"])
    model = example.GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    windows = example.RandomWindows(tokenizer.encode(example.load_text()), config.block_size, 32 * 30, 0)
    for step in range(30):
        x, y = (torch.stack([windows[i][j] for i in range(32 * step, 32 * step + 32)]) for j in (0, 1))
        optimizer.zero_grad()
        F.cross_entropy(model(x).view(-1, config.vocab_size), y.view(-1)).backward()
        if step < 29:  # the last step's gradients are kept
            optimizer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(1, -1)  # (1, Ψ)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).view(1, -1)
    print("| B | weights int8 | gradients int8 | gradients int4 | int8 bytes / fp32 |\n| --- | --- | --- | --- | --- |")
    for block in (32, 64, 128, 256, 512, 1024, 4096):
        errors, codec = [], None
        for rows, bits in ((weights, 8), (grads, 8), (grads, 4)):
            codec = RowCodec(width=rows.shape[1], data=rows.shape[1], itemsize=4, block=block, bits=bits)
            packed, out = torch.empty(1, codec.row_bytes, dtype=torch.uint8), torch.empty_like(rows)
            codec.quantize(rows, packed)
            codec.dequantize(packed, out)
            errors.append(float((out - rows).norm() / rows.norm()))
        int8 = RowCodec(width=weights.shape[1], data=weights.shape[1], itemsize=4, block=block, bits=8).row_bytes
        print(f"| {block} | " + " | ".join(f"{e:.2e}" for e in errors) + f" | {int8 / (4 * weights.shape[1]):.4f} |")


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
    if len(sys.argv) > 2 and sys.argv[1] == "feedback":  # in each rank: error feedback, then the example
        install_error_feedback()
        _run_example(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "blocks"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--link-steps", type=int, default=40, help="steps of the timed runs")
    parser.add_argument("--link", type=float, default=125e6, help="bytes per second of the slowed link (1 Gbit/s)")
    parser.add_argument("--size", default="small")
    parser.add_argument("--devices", type=int, default=2, help="ranks of every run")
    parser.add_argument("--out", default="benchmarks/results/quantized")
    parser.add_argument("--reuse", action="store_true", help="read the runs OUT already holds instead of rerunning")
    args = parser.parse_args()
    run(args) if args.command == "run" else blocks()


if __name__ == "__main__":
    main()
