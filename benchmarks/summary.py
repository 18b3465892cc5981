"""From the per-rank results of every run to one summary per backend: medians, ratios, bytes,
and the issue's targets. Pure functions on plain data (the JSON file holds their input too)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.measure import ddp_step_bytes

# Peak dense throughput per device in TFLOP/s, (TF32 tensor cores, BF16), for MFU on GPUs. A name
# not listed here needs --peak-tflops.
PEAK_TFLOPS = {"H200": (494.7, 989.4), "H100": (494.7, 989.4), "A100": (156.0, 312.0), "L40S": (183.0, 362.0)}
LOSS_TOL = 1e-5  # |loss - another backend's loss| at any step that still counts as "float rounding"
ANALYTIC = ("ddp", "lightning-ddp")  # traffic from the formula: DDP's reducer is C++
_FIRST_RANK = ("engine_step_bytes", "expected_step_bytes", "device_name")  # rank 0's (equal on every rank)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_run(backend: str, ranks: list[dict[str, Any]], *, warmup: int) -> dict[str, Any]:
    """One launch of one backend: step times (the slowest rank's, per step), global losses
    (mean of the ranks' equal-sized batch losses), per-rank maxima of memory."""
    n, steps, first = len(ranks), len(ranks[0]["steps"]), ranks[0]
    times = [max(r["steps"][i]["time_s"] for r in ranks) for i in range(warmup, steps)]
    cpu = [max(r["steps"][i]["cpu_s"] for r in ranks) for i in range(warmup, steps)]
    losses = [sum(r["steps"][i]["loss"] for r in ranks) / n for i in range(steps)]
    out: dict[str, Any] = {
        "step_times_s": times,
        "median_s": statistics.median(times),
        "cpu_s": cpu,
        "median_cpu_s": statistics.median(cpu),
        "losses": losses,
        "model_state_bytes": max((r["model_state_bytes"] for r in ranks), key=lambda s: s["total"]),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "base_rss_bytes": max(r["base_rss_bytes"] for r in ranks),
        # The high-water mark after each step (all steps): growth here is the allocator keeping freed memory.
        "peak_rss_after_step_bytes": [max(r["steps"][i].get("peak_rss_bytes", 0) for r in ranks) for i in range(steps)],
    }
    if backend in ANALYTIC:
        out.update(step_bytes=ddp_step_bytes(first["psi"], 4, n), step_bytes_source="formula (DDP's C++ reducer)")
    else:
        out.update(step_bytes=first["steps"][-1]["comm"], step_bytes_source="counted at torch.distributed")
    if "gather_wait_s" in first["steps"][0]:
        out["gather_wait_s"] = [sum(r["steps"][i]["gather_wait_s"] for r in ranks) / n for i in range(warmup, steps)]
    for key in ("peak_units_alive", "anon_rss_bytes", "peak_device_bytes", *_FIRST_RANK):
        if key in first:
            out[key] = first[key] if key in _FIRST_RANK else max(r[key] for r in ranks)
    return out


def summarize_backends(
    runs: list[dict[str, Any]], *, psi: int, world_size: int, tokens_per_step: int, peak_tflops: float | None
) -> dict[str, dict[str, Any]]:
    """Pool the rounds of each backend. Ratios are per round (adjacent runs), then the median."""
    names = list(dict.fromkeys(r["backend"] for r in runs))
    rounds = sorted({r["round"] for r in runs})
    by = {(r["backend"], r["round"]): r["summary"] for r in runs}
    ref = next((b for b in ("ddp", "lightning-ddp") if b in names), None)  # the losses compared against
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [by[(name, k)] for k in rounds if (name, k) in by]
        times = [t for s in mine for t in s["step_times_s"]]
        median = statistics.median(times)
        first = mine[0]
        entry: dict[str, Any] = {
            "median_step_s": median,
            "p10_step_s": percentile(times, 0.1),
            "p90_step_s": percentile(times, 0.9),
            "round_medians_s": [s["median_s"] for s in mine],
            "load_averages": [r["load_average"][0] for r in runs if r["backend"] == name],
            "median_cpu_s": statistics.median(c for s in mine for c in s["cpu_s"]),
            "tokens_per_s": tokens_per_step / median,
            "losses": first["losses"],
            "loss_max_diff_between_rounds": max(
                (abs(a - b) for s in mine for a, b in zip(s["losses"], first["losses"])), default=0.0
            ),
            "model_state_bytes": first["model_state_bytes"],
            "model_state_vs_16psi_over_n": first["model_state_bytes"]["total"] / (16 * psi / world_size),
            "peak_rss_bytes": max(s["peak_rss_bytes"] for s in mine),
            "peak_rss_growth_bytes": max(s["peak_rss_bytes"] - s["base_rss_bytes"] for s in mine),
            "step_bytes": first["step_bytes"],
            "step_bytes_source": first["step_bytes_source"],
        }
        for key in ("peak_units_alive", "peak_device_bytes", "anon_rss_bytes", *_FIRST_RANK):
            if key in first:
                entry[key] = first[key]
        if "gather_wait_s" in first:
            entry["gather_wait_s_median"] = statistics.median(w for s in mine for w in s["gather_wait_s"])
        if ref is not None:
            entry["loss_max_diff_vs_" + ref] = max(
                abs(a - b) for a, b in zip(first["losses"], by[(ref, rounds[0])]["losses"])
            )
        if peak_tflops:
            entry["mfu"] = 6 * psi * entry["tokens_per_s"] / (peak_tflops * 1e12 * world_size)
        for field, key in (("ratio_vs", "median_s"), ("cpu_ratio_vs", "median_cpu_s")):
            per_round = {other: [by[(name, k)][key] / by[(other, k)][key] for k in rounds
                                 if (name, k) in by and (other, k) in by] for other in names}  # fmt: skip
            entry[field] = {other: statistics.median(r) for other, r in per_round.items() if r}
        out[name] = entry
    return out


def check_targets(backends: dict[str, dict[str, Any]], *, psi: int, world_size: int) -> list[dict[str, Any]]:
    """Issue 13's targets for zero3 (prefetch=1), each with the numbers behind the verdict."""
    z, targets = backends.get("zero3-p1"), []
    if z is None:
        return []

    def add(name: str, met: bool, detail: str) -> None:
        targets.append({"target": name, "met": bool(met), "detail": detail})

    for other, limit in (("deepspeed", 0.90), ("fsdp2", 0.90), ("lightning-ddp", 1.05)):
        if other in backends:  # CPU time: what the rank processes spent, barely changed by contention
            r, cpu = z["ratio_vs"][other], z["cpu_ratio_vs"][other]
            add(f"step time <= {limit:.2f}x {other}", r <= limit, f"median of per-round ratios {r:.3f}; CPU {cpu:.3f}")
    if "zero3-p0" in backends:
        w0, w1 = backends["zero3-p0"]["gather_wait_s_median"], z["gather_wait_s_median"]
        add("prefetch=1 waits less than prefetch=0", w1 < w0, f"gather wait {w0 * 1e3:.1f} -> {w1 * 1e3:.1f} ms/step")
    total = z["model_state_bytes"]["total"]
    add("model state <= 1.01 x 16Ψ/N", total <= 1.01 * 16 * psi / world_size,
        f"{total:,} B = {total / (16 * psi / world_size):.4f} x 16Ψ/N")  # fmt: skip
    counted = {k: v["payload_bytes"] for k, v in z["step_bytes"].items() if k in ("all_gather", "reduce_scatter")}
    engine = {k: v["payload_bytes"] for k, v in z.get("engine_step_bytes", {}).items() if k in counted}
    expected = {k: z.get("expected_step_bytes", {}).get(k) for k in counted}
    add("bytes per step = formula", counted == expected == engine and len(counted) == 2,
        f"counted {counted}, engine {engine}, formula {expected}; {sum(counted.values()) / psi / 4:.4f} Ψb")
    for other in ("fsdp2", "deepspeed"):
        if other in backends:
            mine, theirs = z["peak_rss_bytes"], backends[other]["peak_rss_bytes"]
            add(f"peak RSS below {other}'s", mine < theirs, f"{mine / 2**20:,.0f} vs {theirs / 2**20:,.0f} MiB")
    for other in ("ddp", "lightning-ddp", "deepspeed"):
        if other in backends:
            diff = max(abs(a - b) for a, b in zip(z["losses"], backends[other]["losses"]))
            add(f"loss = {other}'s within {LOSS_TOL:g}", diff <= LOSS_TOL, f"max |Δloss| {diff:.2e}")
    return targets


def peak_tflops_for(device_name: str | None, override: float | None) -> float | None:
    tf32 = (tf32 for key, (tf32, _bf16) in PEAK_TFLOPS.items() if key in (device_name or ""))
    return override or next(tf32, None)
