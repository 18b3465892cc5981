"""One command that proves the GPU paths on one GPU, in a few minutes; prints PASS/FAIL per check.

    python benchmarks/gpu_check.py              # on a machine with a CUDA GPU (< 5 min)
    python benchmarks/gpu_check.py --dry-run    # the same code paths on CPU/gloo (CI, ~1 min)

NCCL needs one GPU per rank, so on one GPU:
(a) NCCL at world size 1 with the one-rank shortcut off (real async NCCL collectives, waits and
    buffer lifetimes on the comm streams), equal bitwise to the shortcut run;
(b) 2-4 gloo processes on cuda:0 (gloo takes CUDA tensors: the native collective path on real
    side streams), each against a single-process reference: fp32, bf16 `param_dtype`,
    `shard_size=2` at 4 ranks, overlapping reductions;
(c) Lightning, `devices=1`: 32-true, bf16-mixed, 16-mixed losses against a plain single-device
    Trainer; sharded and full save then resume; a standalone `trainer.validate` (the
    inference_mode path); peak device memory against 16Ψ + a few units;
(d) a steady training step under `torch.cuda.set_sync_debug_mode("warn")` (no engine sync
    but the one tag check) and a profiler trace in which NCCL kernels overlap compute kernels.
In `--dry-run` (a) runs on gloo/CPU, (b) on CPU, (c) with `accelerator="cpu"` and 32-true /
bf16-mixed, (d) counts the engine's host reads and skips the trace's overlap test.
docs/performance.md ("The GPU check") says how to read the output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.launch import run_ranks  # noqa: E402
from lightning_zero3.engine import ShardedModel  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []
# `--fast` (the test suite's dry run): every code path once, fewer variants of each.
FAST = False


def report(name: str, ok: bool, figures: str) -> None:
    RESULTS.append((name, ok, figures))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {figures}", flush=True)


# ---- model and data ---------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Input projection, 4 residual blocks (units), head: 5 units with the root."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(4))
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(step: int, device: torch.device, size: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 16, generator=g).to(device), torch.randn(size, 8, generator=g).to(device)


def _fresh(device: torch.device) -> Net:
    torch.manual_seed(0)
    return Net().to(device)


def _train_sharded(rank: int, world: int, device: str, steps: int, options: dict, shortcut: bool = True) -> dict:
    """Train Net sharded over `world` ranks for `steps` SGD steps; whole parameters and losses."""
    dev = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = _fresh(dev)
    sharded = ShardedModel(model, device=dev, **options)
    sharded.comm.one_rank_shortcut = shortcut
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    autocast = options.get("param_dtype") is not None
    losses = []
    for step in range(steps):
        x, y = batch(step, dev)
        per = x.shape[0] // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.cpu() for k, v in sharded.full_state_dict(to_rank=None).items()}
    return {"state": state, "losses": losses, "host_reads": sharded.checks.host_reads}


def _reference(device: torch.device, steps: int, bf16: bool = False) -> dict:
    model = _fresh(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            F.mse_loss(model(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


# ---- (a) ----------------------------------------------------------------------------------------
def check_a(dry: bool) -> None:
    backend, device = ("gloo", "cpu") if dry else ("nccl", "cuda:0")
    options = {"prefetch": 2, "reductions_in_flight": 2}
    short = run_ranks(_train_sharded, 1, device, 4, options, True, backend=backend)[0]
    real = run_ranks(_train_sharded, 1, device, 4, options, False, backend=backend)[0]
    diff = _max_diff(real["state"], short["state"])
    report(f"(a) {backend} world size 1, real collectives vs shortcut", diff == 0.0, f"max |diff| {diff:.3g} (bitwise)")


# ---- (b) ----------------------------------------------------------------------------------------
def check_b(dry: bool) -> None:
    device = "cpu" if dry else "cuda:0"
    steps = 3
    cases = [
        ("fp32, 2 ranks", 2, {}, 1e-5),
        ("bf16 param_dtype, 2 ranks", 2, {"param_dtype": torch.bfloat16}, 3e-2),
        ("shard_size=2, 4 ranks", 4, {"shard_size": 2}, 1e-5),
        ("reductions_in_flight=2, 3 ranks", 3, {"reductions_in_flight": 2}, 1e-5),
    ]
    if FAST:
        both = {"shard_size": 2, "reductions_in_flight": 2}
        cases = [("shard_size=2 + reductions_in_flight=2, 4 ranks", 4, both, 1e-5)]
    for name, world, options, tol in cases:
        reference = _reference(torch.device(device), steps, bf16="param_dtype" in options)
        results = run_ranks(_train_sharded, world, device, steps, options, backend="gloo")
        diff = max(_max_diff(r["state"], reference) for r in results)
        report(f"(b) gloo on {device}: {name}", diff < tol, f"max |param - reference| {diff:.3g} (tol {tol:g})")


# ---- (c) ----------------------------------------------------------------------------------------
def _lit_module() -> Any:
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.losses: list[float] = []

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            loss = F.mse_loss(self.net(b[0]).float(), b[1])
            self.losses.append(float(loss))
            return loss

        def validation_step(self, b: Any, i: int) -> None:
            self.log("val_loss", F.mse_loss(self.net(b[0]).float(), b[1]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return Lit()


def _loader() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    xs, ys = zip(*(batch(step, torch.device("cpu"), 8) for step in range(4)))  # 4 batches: one epoch
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)


def _trainer(accelerator: str, precision: str, strategy: Any, **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    options = dict(accelerator=accelerator, devices=1, precision=precision, strategy=strategy, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, max_steps=4, use_distributed_sampler=False)  # fmt: skip
    options.update(kwargs)
    return pl.Trainer(**options)


def check_c(dry: bool) -> None:
    from lightning_zero3 import ZeRO3Strategy

    accelerator = "cpu" if dry else "gpu"
    precisions = ["32-true"] if FAST else ["32-true", "bf16-mixed"] + ([] if dry else ["16-mixed"])
    for precision in precisions:
        plain, zero3 = _lit_module(), _lit_module()
        _trainer(accelerator, precision, "auto").fit(plain, _loader())
        if not dry:
            torch.cuda.reset_peak_memory_stats()
        strategy = ZeRO3Strategy()
        _trainer(accelerator, precision, strategy).fit(zero3, _loader())
        diff = max(abs(a - b) for a, b in zip(plain.losses, zero3.losses))
        tol = 1e-5 if precision == "32-true" else 5e-2
        figures = f"max |loss diff| {diff:.3g} over 4 steps"
        report(f"(c) Lightning {precision}: loss vs plain Trainer", diff < tol, figures)
        if not dry and precision == "32-true":
            psi = sum(p.numel() for p in Net().parameters())
            peak = torch.cuda.max_memory_allocated()
            bound = 16 * psi + 4 * 4 * psi // 5 + 64 * 2**20  # state + a few units (of 5) + activations/context
            report("(c) peak device memory", peak <= bound, f"{peak / 2**20:.1f} MiB vs bound {bound / 2**20:.1f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        resumed_losses = {}
        for kind in ("plain", "sharded") if FAST else ("plain", "sharded", "full"):

            def strategy(kind: str = kind) -> Any:
                return "auto" if kind == "plain" else ZeRO3Strategy(state_dict_type=kind)

            first = _lit_module()
            t = _trainer(accelerator, "32-true", strategy(), max_steps=4)
            t.fit(first, _loader())
            path = str(Path(tmp) / f"{kind}.ckpt")
            t.save_checkpoint(path)
            resumed = _lit_module()
            _trainer(accelerator, "32-true", strategy(), max_steps=8).fit(resumed, _loader(), ckpt_path=path)
            resumed_losses[kind] = resumed.losses
        for kind in [k for k in resumed_losses if k != "plain"]:
            # Against the plain Trainer's own save + resume (Lightning decides which batches follow).
            diff = max(abs(a - b) for a, b in zip(resumed_losses[kind], resumed_losses["plain"]))
            ok = diff < 1e-5 and len(resumed_losses[kind]) == 4
            report(f"(c) {kind} save + resume", ok, f"max |loss diff| vs plain Trainer after resume {diff:.3g}")
    plain, zero3 = _lit_module(), _lit_module()
    expected = _trainer(accelerator, "32-true", "auto").validate(plain, _loader(), verbose=False)[0]["val_loss"]
    got = _trainer(accelerator, "32-true", ZeRO3Strategy()).validate(zero3, _loader(), verbose=False)[0]["val_loss"]
    report("(c) standalone trainer.validate", abs(got - expected) < 1e-5, f"val_loss {got:.6f} vs {expected:.6f}")


# ---- (d) ----------------------------------------------------------------------------------------
def _step_syncs_and_trace(rank: int, world: int, device: str, trace: str) -> dict:
    dev = torch.device(device)
    model = _fresh(dev)
    sharded = ShardedModel(model, device=dev, prefetch=1, reductions_in_flight=2)
    sharded.comm.one_rank_shortcut = False
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> None:
        x, y = batch(i, dev, 256)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(2):
        step(i)  # record the order, warm up
    reads = sharded.checks.host_reads
    warned = 0
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(2)
        torch.cuda.set_sync_debug_mode(0)
        warned = len(caught)
    else:
        step(2)
    reads = sharded.checks.host_reads - reads
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(3, 5):
            step(i)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(trace)
    overlap_us = 0.0
    if dev.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        nccl = [e.time_range for e in kernels if "nccl" in e.name.lower()]
        compute = [e.time_range for e in kernels if "nccl" not in e.name.lower()]
        for a in nccl:
            for b in compute:
                overlap_us += max(0.0, min(a.end, b.end) - max(a.start, b.start))
    labels = sum(1 for e in prof.events() if e.name.startswith("ZeRO3::"))
    return {"reads": reads, "warned": warned, "overlap_us": overlap_us, "labels": labels}


def check_d(dry: bool, out: Path) -> None:
    backend, device = ("gloo", "cpu") if dry else ("nccl", "cuda:0")
    trace = str(out / "gpu_check_trace.json")
    result = run_ranks(_step_syncs_and_trace, 1, device, trace, backend=backend)[0]
    figures = f"engine host reads in the step {result['reads']}"
    if not dry:
        figures += f", sync-debug warnings {result['warned']}"
    report("(d) one host sync per training step", result["reads"] <= 1 and result["warned"] <= 1, figures)
    if dry:
        report("(d) profiler trace written", result["labels"] > 0, f"{result['labels']} ZeRO3:: ranges in {trace}")
    else:
        ok = result["overlap_us"] > 0
        report("(d) NCCL kernels overlap compute", ok, f"{result['overlap_us']:.0f} us of overlap; trace {trace}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run the same code paths on CPU/gloo")
    parser.add_argument("--only", default="abcd", help="which checks, e.g. 'ad'")
    parser.add_argument("--out", default=".", help="where the profiler trace goes")
    parser.add_argument("--fast", action="store_true", help="fewer variants per check (the test suite's run)")
    args = parser.parse_args(argv)
    global FAST
    FAST = args.fast
    RESULTS.clear()
    if not args.dry_run and not torch.cuda.is_available():
        print("No CUDA device: run with --dry-run for the CPU version of these checks.")
        return 2
    start = time.perf_counter()
    checks = {"a": check_a, "b": check_b, "c": check_c}
    for key in args.only:
        try:
            if key == "d":
                check_d(args.dry_run, Path(args.out))
            else:
                checks[key](args.dry_run)
        except Exception as err:  # noqa: BLE001 - one broken check must not hide the others
            report(f"({key}) crashed", False, f"{type(err).__name__}: {str(err)[-600:]}")
    failed = [name for name, ok, _ in RESULTS if not ok]
    mode = "dry run on CPU" if args.dry_run else torch.cuda.get_device_name()
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} passed ({mode}, {time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
