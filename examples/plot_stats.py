"""Plot what `ShardingStatsMonitor` logged per optimizer step (a CSVLogger's metrics.csv):
bytes per collective next to the formula's, seconds waiting for All-Gathers, units whole at the
peak, and memory. Needs matplotlib (`pip install -e ".[bench]"`).

    python examples/train_gpt.py --log-dir logs
    python examples/plot_stats.py logs/train_gpt/version_0/metrics.csv --out docs/figures/train-gpt-stats.png
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

PREFIX = "zero3/"
STEP = "step (Lightning's: the first optimizer step is 0)"


def read(path: str) -> dict[str, list[tuple[int, float]]]:
    """Each `zero3/` metric's (step, value) pairs at the CSV's own step, Lightning's (the first
    optimizer step is 0, as for the losses `self.log` writes); the other columns are left out."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path) as file:
        for row in csv.DictReader(file):
            for key, value in row.items():
                if key.startswith(PREFIX) and value != "":
                    series[key.removeprefix(PREFIX)].append((int(row["step"]), float(value)))
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", help="metrics.csv written by a CSVLogger with ShardingStatsMonitor")
    parser.add_argument("--out", default="stats.png", help="PNG to write; default stats.png")
    args = parser.parse_args()
    series = read(args.metrics)
    if not series:
        raise SystemExit(f"{args.metrics} holds no {PREFIX} metrics: was ShardingStatsMonitor among the callbacks?")

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    bytes_ax, wait_ax, units_ax, memory_ax = axes.flat
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        for suffix, style in (("", "-"), ("_formula", "--")):
            points = series.get(f"{kind}_bytes{suffix}")
            if points:
                label = f"{kind}{' (formula)' if suffix else ''}"
                bytes_ax.plot(*zip(*[(s, v / 2**20) for s, v in points]), style, label=label)
    bytes_ax.set(title="payload per optimizer step, this rank", ylabel="MiB")
    bytes_ax.legend(fontsize="small")
    wait_ax.plot(*zip(*series["gather_wait_s"]))
    wait_ax.set(title="time waiting for All-Gathers", ylabel="s")
    units_ax.plot(*zip(*series["peak_units_alive"]), drawstyle="steps-post")
    units_ax.set(title="units whole at the peak (since fit started)", ylabel="units", xlabel=STEP)
    memory = "cuda_max_memory_allocated_bytes" if "cuda_max_memory_allocated_bytes" in series else "rss_anon_bytes"
    memory_ax.plot(*zip(*[(s, v / 2**20) for s, v in series[memory]]))
    memory_ax.set(title=memory.removesuffix("_bytes").replace("_", " "), ylabel="MiB", xlabel=STEP)
    fig.suptitle(f"ShardingStatsMonitor, rank 0: {args.metrics}", fontsize="small")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
