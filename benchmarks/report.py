"""Markdown tables and PNG charts from the summaries in `summary.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.backends import BACKENDS

MB = 1e6
MIB = 2**20
_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _bytes_from(entry: dict) -> str:
    if "formula" in entry["step_bytes_source"]:
        return "formula"
    via = [f"{kind.replace('_', '-')} as {v['via']}" for kind, v in entry["step_bytes"].items() if "via" in v]
    return "counted" + (f" ({'; '.join(via)})" if via else "")


def _label(name: str, short: bool = False) -> str:
    return BACKENDS[name][int(short)] if name in BACKENDS else name


def _ratio(entry: dict[str, Any], other: str, field: str = "ratio_vs") -> str:
    return f"{entry[field][other]:.3f}" if other in entry[field] else "-"


def time_table(backends: dict[str, dict[str, Any]]) -> str:
    mfu = any("mfu" in e for e in backends.values())
    head = (
        "backend;step median (s);p10 (s);p90 (s);÷ DDP;÷ FSDP2;÷ Lightning DDP;÷ DeepSpeed;tokens/s;CPU s / "
        "step;CPU ÷ Lightning DDP;gather wait / step (ms);load (1 min) at its runs"
    ).split(";") + (["MFU"] if mfu else [])
    rows = []
    for name, e in backends.items():
        row = [_label(name), *(f"{e[k]:.3f}" for k in ("median_step_s", "p10_step_s", "p90_step_s"))]
        row += [_ratio(e, other) for other in ("ddp", "fsdp2", "lightning-ddp", "deepspeed")]
        row += [
            f"{e['tokens_per_s']:,.0f}",
            f"{e['median_cpu_s']:.3f}",
            _ratio(e, "lightning-ddp", "cpu_ratio_vs"),
            f"{e['gather_wait_s_median'] * 1e3:.1f}" if "gather_wait_s_median" in e else "-",
            "-" if not e.get("load_averages") else f"{min(e['load_averages']):.1f}-{max(e['load_averages']):.1f}",
        ]
        if mfu:
            row.append(f"{e['mfu'] * 100:.1f}%" if "mfu" in e else "-")
        rows.append(row)
    return _table(head, rows)


def memory_table(backends: dict[str, dict[str, Any]]) -> str:
    head = (
        "backend;model state / rank (MB);÷ 16Ψ/N;peak RSS (MiB);RssAnon at end (MiB);All-Gather (MB);Reduce-Scatter "
        "(MB);All-Reduce (MB);wire (MB);bytes from;peak units alive;max \\|Δloss\\| vs DDP"
    ).split(";")
    device = any("peak_device_bytes" in e for e in backends.values())
    if device:
        head.insert(4, "peak device memory (MiB)")
    rows = []
    for name, e in backends.items():
        sb = e["step_bytes"]
        payload = {kind: f"{sb[kind]['payload_bytes'] / MB:.2f}" if kind in sb else "-" for kind in _KINDS}
        wire = sum(v["wire_bytes"] for v in sb.values()) / MB
        diff = next((v for k, v in e.items() if k.startswith("loss_max_diff_vs_")), None)
        row = [
            _label(name),
            f"{e['model_state_bytes']['total'] / MB:.2f}",
            f"{e['model_state_vs_16psi_over_n']:.4f}",
            f"{e['peak_rss_bytes'] / MIB:,.0f}",
            f"{e['anon_rss_bytes'] / MIB:,.0f}" if "anon_rss_bytes" in e else "-",
            *(payload[kind] for kind in _KINDS),
            f"{wire:.2f}",
            _bytes_from(e),
            str(e.get("peak_units_alive", "-")),
            "-" if diff is None else f"{diff:.1e}",
        ]
        if device:
            row.insert(4, f"{e['peak_device_bytes'] / MIB:,.0f}" if "peak_device_bytes" in e else "-")
        rows.append(row)
    return _table(head, rows)


def targets_list(targets: list[dict[str, Any]]) -> str:
    return "\n".join(f"- {'met' if t['met'] else '**MISSED**'}: {t['target']} ({t['detail']})" for t in targets)


def scaling_table(scaling: list[dict[str, Any]]) -> str:
    head = (
        "backend;N;model state / rank (MB);16Ψ/N (MB);÷ 16Ψ/N;step median (s);CPU s / step;threads / "
        "rank;peak RSS (MiB);load (1 min)"
    ).split(";")
    rows = [
        [
            _label(s["backend"]),
            str(s["world_size"]),
            f"{s['model_state_bytes'] / MB:.2f}",
            f"{s['sixteen_psi_over_n'] / MB:.2f}",
            f"{s['model_state_bytes'] / s['sixteen_psi_over_n']:.4f}",
            f"{s['median_step_s']:.3f}",
            f"{s['median_cpu_s']:.3f}" if "median_cpu_s" in s else "-",
            str(s.get("threads_per_rank", "-")),
            f"{s['peak_rss_bytes'] / MIB:,.0f}",
            f"{s['load_average_1min']:.1f}" if "load_average_1min" in s else "-",
        ]
        for s in scaling
    ]
    return _table(head, rows)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """PNG charts of what `result` holds; [] with a message when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no charts written. Install it with: pip install -e '.[bench]'")
        return []
    written, backends = [], result.get("backends")
    if backends:
        names = list(backends)
        ref = next((r for r in ("lightning-ddp", "ddp") if r in names), names[0])
        fig, ax = plt.subplots(figsize=(9, 0.55 * len(names) + 1.6))
        medians = [backends[n]["median_step_s"] for n in names]
        p90 = [backends[n]["p90_step_s"] - backends[n]["median_step_s"] for n in names]
        ax.barh([_label(n, True) for n in names], medians, xerr=[[0] * len(names), p90], color="tab:blue", capsize=3)
        for i, n in enumerate(names):
            ax.plot(backends[n]["round_medians_s"], [i] * len(backends[n]["round_medians_s"]), "k.", markersize=4)
            ratio = backends[n]["ratio_vs"].get(ref, float("nan"))
            label = f"{medians[i]:.3f} s  ({ratio:.3f}x {_label(ref, True)})"
            ax.text(medians[i] * 0.02, i, label, va="center", color="white", fontsize=8)
        ax.invert_yaxis()
        cfg = result["config"]
        ax.set_xlabel("step time (s): bar median, whisker p90, dots per-round medians; ratio: median per-round ratio")
        ax.set_title(f"GPT {cfg['size']} (Ψ = {result['psi']:,}), {cfg['world_size']} ranks, {cfg['accelerator']}")
        written.append(_save(fig, out / "step_time.png"))
    if result.get("scaling"):
        scaling, psi = result["scaling"], result["psi"]
        ns = sorted({s["world_size"] for s in scaling})
        fig, (left, right, times) = plt.subplots(1, 3, figsize=(15, 4.5))
        styles = ["o-", "s--", "^:", "d-.", "v-"]
        for i, name in enumerate(dict.fromkeys(s["backend"] for s in scaling)):
            pts = [s for s in scaling if s["backend"] == name]
            x = [s["world_size"] for s in pts]
            for ax, key, unit in ((left, "model_state_bytes", MB), (right, "peak_rss_bytes", MIB),
                                  (times, "median_step_s", 1)):  # fmt: skip
                ax.plot(x, [s[key] / unit for s in pts], styles[i % len(styles)], label=_label(name), markersize=7 - i)
        left.plot(ns, [16 * psi / n / MB for n in ns], "k", alpha=0.3, linewidth=6, label="16Ψ/N", zorder=0)
        for ax, unit, title in ((left, "MB per rank", "model state: params + grads + AdamW (exact)"),
                                (right, "MiB per rank", "peak RSS of the rank process (whole process)")):  # fmt: skip
            ax.set_ylabel(unit)
            ax.set_title(title)
        times.set_ylabel("s")
        loads = [s["load_average_1min"] for s in scaling if "load_average_1min" in s]
        load = f", load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
        times.set_title(f"median step time (N > {result['machine']['cores']}: oversubscribed{load})", fontsize=9)
        for ax in (left, right, times):
            ax.set_xticks(ns)
            ax.set_xlabel("ranks N")
            ax.set_ylim(bottom=0)
        left.legend(fontsize=8)
        fig.suptitle(f"GPT {result['config']['size']} (Ψ = {psi:,}), fp32, {result['config']['accelerator']}")
        written.append(_save(fig, out / "memory_scaling.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
