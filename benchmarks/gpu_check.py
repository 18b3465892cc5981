"""The CUDA paths on one GPU (under 10 minutes): one line per check, PASS / FAIL / INFO.

    python benchmarks/gpu_check.py                      # needs a CUDA device and NCCL
    python benchmarks/gpu_check.py --dry-run [--fast]   # the same code on CPU/gloo (CI)

Checks run at world size 1 with the engine's one-rank shortcut off (real collectives on the side
streams; a counter at `torch.distributed` proves it), (a) and (g) on 2 ranks when 2 GPUs are present.
(a) stream races: identical blocks (units share pool keys), fp32 and bf16, bitwise equal with and
    without `torch.cuda._sleep` before issuing every collective; 2 steps under the CUDA sanitizer
    (on CPU: the stand-in of tests/support/cuda_standin.py).
(b) syncs, batches on the device: 1 per steady step (32-true, bf16-mixed, 16-mixed; fused AdamW;
    Fabric); an evaluation pass of an untrained model checks each gather at once: 1 per unit.
(c) memory: each step's peak within model state + (root, live, prefetched, in-flight) units + the
    plain model's step transient, flat over 20 steps; ~0 left after `fit`; `init_module()` builds ~0.
(d) bf16-mixed / 16-mixed x foreach / fused AdamW x clipping off / on against a plain Fabric loop
    over 20 steps; an fp16 overflow skips the step and halves the scale.
(e) Lightning: fit, full and sharded save, resume, standalone validate and predict against a plain
    Trainer; step time and GPU idle fraction (profiler trace) next to the plain model.
(f) `reshard_after_forward=False` bitwise equal to the plain sharded run, `offload="host"` and its
    unsynced accumulation within 1e-5 (CPU AdamW against CUDA AdamW: not bitwise); syncs per
    steady step with offload; offload saves at least AdamW's state.
(g) 2 ranks (2 GPUs; 4 with 4 GPUs and in a dry run, on gloo): a real All-Gather; `shard_size`,
    integer (slices at 4 ranks) and False `reshard_after_forward`, offload, within 1e-5 of the default.
(h) one GPU, a Llama-like model (8 blocks, hidden 2048, sequence 2048, bf16): syncs in a steady step
    against the plain model's; pool and device memory after `gathered_for_inference()` and
    `full_state_dict()` mid-training; latency injected before each All-Gather hidden by prefetch
    (>= 80%, against prefetch=0); offload's pinned staging reused; 2 steps under
    TORCH_CUDA_SANITIZER=1 in a subprocess (`--sanitize-step`).
`--dry-run`: every section's code runs on CPU; what CPU can show gets a verdict (collectives,
losses, checkpoints, fp16 overflow, races through the stand-in); what only a GPU shows (syncs,
device memory) prints `RAN`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import DeviceType
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.launch import run_ranks  # noqa: E402
from benchmarks.measure import DistCounter  # noqa: E402
from lightning_zero3 import ShardedModel, ZeRO3FabricStrategy, ZeRO3Strategy  # noqa: E402
from tests.support.cuda_standin import standin  # noqa: E402

RESULTS: list[str] = []
FAST = False  # --fast: fewer variants per check (the test suite's dry run)
TOLERANCE = 1e-5  # relative, where devices or reduction orders differ
SLEEP_CYCLES = 10_000_000  # ~5 ms at a ~2 GHz GPU clock


def report(verdict: str, check: str, figures: str) -> None:
    RESULTS.append(verdict)
    print(f"{verdict:<4}  ({check}) {figures}", flush=True)


def verdict(ok: bool, dry: bool = False) -> str:
    return "RAN" if dry else "PASS" if ok else "FAIL"


def shortcut_off(sharded: ShardedModel) -> None:
    """Real collectives at world size 1 (no public option yet: fails loudly if the attribute goes)."""
    comm = sharded.shard_comms[0]
    if not hasattr(comm, "one_rank_shortcut"):
        raise RuntimeError("the engine has no `comm.one_rank_shortcut` to turn off: give the check a new knob")
    comm.one_rank_shortcut = False  # type: ignore[union-attr]


def collectives(counter: DistCounter) -> int:  # seen at `torch.distributed`: the one-rank shortcut makes none
    return sum(kind["calls"] for kind in counter.counts.values())


@contextmanager
def syncs_counted(on: bool) -> Iterator[list[int]]:
    """Synchronizing CUDA operations inside the block (torch's sync-debug warnings), appended on exit."""
    count: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if on:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            if on:
                torch.cuda.set_sync_debug_mode(0)
    count.append(sum("synchroniz" in str(w.message) for w in caught))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Input projection, `blocks` identical residual blocks (one unit each), head (the root)."""

    def __init__(self, dim: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, dim), nn.Linear(dim, 8)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # (B, dim)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, 8)


def fresh(dim: int = 64, blocks: int = 4, device: Any = "cpu") -> Net:
    torch.manual_seed(0)
    return Net(dim, blocks).to(device)


def batch(step: int, device: Any, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 16, generator=g).to(device), torch.randn(size, 8, generator=g).to(device)


def ensure_group(device: torch.device) -> None:
    """A world-size-1 process group in this process."""
    store = dist.FileStore(tempfile.mktemp(prefix="gpu_check_store"), 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)


# ---- (a) stream races -------------------------------------------------------------------------
def _delayed(original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:  # the collective starts late; the events after it are not delayed
        torch.cuda._sleep(SLEEP_CYCLES)
        return original(*args, **kwargs)

    return call


def _race_run(rank: int, world: int, device: str, dim: int, dtype: str, steps: int, delay: bool, sanitize: bool
              ) -> dict:  # fmt: skip
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS bitwise run to run
    torch.use_deterministic_algorithms(True, warn_only=True)
    if sanitize and dev.type == "cuda":
        torch.cuda._sanitizer.enable_cuda_sanitizer()
    with standin() if sanitize and dev.type == "cpu" else nullcontext() as mode:  # the CPU's sanitizer
        result = _race_steps(dev, dim, dtype, steps, delay)
    return {**result, "races": mode.races[:3] if mode is not None else []}


def _race_steps(dev: torch.device, dim: int, dtype: str, steps: int, delay: bool) -> dict:
    counter = DistCounter()
    counter.install()
    if delay and dev.type == "cuda":
        for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
                     "all_reduce", "broadcast"):  # fmt: skip
            if hasattr(dist, name):
                setattr(dist, name, _delayed(getattr(dist, name)))
    model = fresh(dim, 8, dev)
    bf16 = dtype == "bf16"
    sharded = ShardedModel(model, device=dev, prefetch=2, param_dtype=torch.bfloat16 if bf16 else None)
    shortcut_off(sharded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = batch(step, dev, 64)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = sharded.full_state_dict(to_rank=None)  # host tensors of their own
    return {"state": state, "collectives": collectives(counter)}


def two_ranks(dry: bool) -> bool:
    return dry or torch.cuda.device_count() >= 2


def check_a(dry: bool) -> None:
    device, backend, dim = ("cpu", "gloo", 64) if dry else ("cuda", "nccl", 1024)
    world = 2 if two_ranks(dry) else 1  # at world size 1 NCCL moves no data: a missing wait could pass
    for dtype in ("fp32",) if FAST else ("fp32", "bf16"):
        plain, late = (run_ranks(_race_run, world, device, dim, dtype, 4, late, False, backend=backend)[0]
                       for late in (False, True))  # fmt: skip
        count = plain["collectives"]
        report(verdict(count >= 4 * 9), "a", f"{dtype}: {count} collectives in 4 steps of 9 units on {world} rank(s)")
        same = all(torch.equal(plain["state"][k], late["state"][k]) for k in plain["state"])
        report(verdict(same, dry), "a", f"{dtype}: bitwise equal with delayed side streams: {same}")
    name = "the CPU stand-in for CUDA's ordering rules" if dry else "the CUDA sanitizer"
    try:
        races = [r for result in run_ranks(_race_run, world, device, dim, "fp32", 2, True, True, backend=backend)
                 for r in result["races"]]  # fmt: skip
        report(verdict(not races), "a", f"2 steps under {name}: {races or 'no race reported'}")
    except Exception as err:  # noqa: BLE001 - the sanitizer's report is the figure
        report("FAIL", "a", f"{name}: {str(err)[-800:]}")


# ---- Fabric loops, for (b) and (d) ---------------------------------------------------------------
def fabric_run(dev: torch.device, precision: str, *, zero3: bool, fused: bool = False, clip: bool = False,
               steps: int = 20, overflow_at: int | None = None, sync_window: int | None = None) -> dict:  # fmt: skip
    strategy = ZeRO3FabricStrategy() if zero3 else "auto"
    fabric = L.Fabric(accelerator=dev.type, devices=1, strategy=strategy, **precision_option(precision, dev))
    fabric.launch()
    model = fresh(64, 4, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=not fused)
    model, optimizer = fabric.setup(model, optimizer)
    if zero3:
        shortcut_off(fabric.strategy.sharded_model(model))
    data = [batch(step, dev) for step in range(steps)]  # on the device before any timing or sync count
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    out: dict[str, Any] = {"losses": [], "syncs": "-"}  # counted on CUDA only
    for step, (x, y) in enumerate(data):
        window = step == sync_window and dev.type == "cuda"
        before = [p.detach().clone() for p in model.parameters()] if step == overflow_at else None
        scale = scaler.get_scale() if scaler is not None and before is not None else None
        with syncs_counted(window) as syncs:
            loss = F.mse_loss(model(x).float(), y)
            fabric.backward(loss * float("inf") if step == overflow_at else loss)
            if clip:
                fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
        if window:
            out["syncs"] = syncs[0]
        if before is not None:
            out["overflow"] = {
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
                "scale": (scale, scaler.get_scale() if scaler is not None else None),
            }
        out["losses"].append(loss.item())
    if zero3:  # read after the loop: on CUDA the events are read then (a sync outside any window)
        out["gather_wait_s"] = fabric.strategy.sharded_model(model).stats.shard_group.last_step_gather_wait_s
    return out


def precision_option(precision: str, dev: torch.device) -> dict[str, Any]:
    """Fabric's precision argument; on CPU, where Lightning turns 16-mixed into bf16-mixed, its
    fp16 plugin with a CPU GradScaler (dry runs exercise loss scaling)."""
    if precision != "16-mixed" or dev.type != "cpu":
        return {"precision": precision}
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}


# ---- (b) syncs --------------------------------------------------------------------------------
def check_b(dry: bool) -> None:
    dev = torch.device("cpu" if dry else "cuda:0")
    for precision in ["32-true"] if FAST else ["32-true", "bf16-mixed"] + ([] if dry else ["16-mixed"]):
        run = fabric_run(dev, precision, zero3=True, fused=True, steps=5, sync_window=4)
        report(verdict(run["syncs"] == 1, dry), "b", f"{precision}, fused AdamW: {run['syncs']} syncs in a steady step")
    run = fabric_run(dev, "32-true", zero3=True, clip=True, steps=5, sync_window=4)  # foreach norm and clip
    wait = run["gather_wait_s"]
    detail = f"{run['syncs']} syncs; last step's gather wait {wait * 1e3:.2f} ms"
    report(verdict(wait >= 0 and run["syncs"] == 1, dry and wait >= 0), "b", f"32-true, clipping: {detail}")
    fabric = L.Fabric(accelerator=dev.type, devices=1, strategy=ZeRO3FabricStrategy())
    fabric.launch()
    model = fabric.setup_module(fresh(64, 4, "cpu"))
    shortcut_off(fabric.strategy.sharded_model(model))
    units = len(fabric.strategy.sharded_model(model)._units)
    x, _ = batch(0, dev)
    with syncs_counted(not dry) as syncs, torch.no_grad():
        model(x)
    count = "-" if dry else syncs[0]  # no order recorded: each gather is checked at once (checks.py)
    report(verdict(syncs[0] <= units, dry), "b", f"evaluation pass with no prior training: {count} syncs, "
           f"at most 1 per unit ({units})")  # fmt: skip


class DeviceMemory:
    """The CUDA allocator's figures after a collection (module<->hooks and Trainer<->module cycles
    keep tensors alive until one); zeros on CPU, so a dry run goes through the same code."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
        return torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() if self.cuda else 0


# ---- (c) memory -------------------------------------------------------------------------------
def check_c(dry: bool) -> None:
    dev = torch.device("cpu" if dry else "cuda:0")
    memory = DeviceMemory(dev)
    dim, blocks, prefetch, in_flight, mib = 64 if dry else 1024, 6, 1, 2, 2**20
    (x, y), plain = batch(0, dev, 256), fresh(dim, blocks, dev)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for _ in range(2):  # the second step's peak above its start: activations or AdamW's temporaries, + grads
        resting = memory.allocated()
        memory.reset()
        F.mse_loss(plain(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    transient = memory.peak() - resting - sum(4 * p.numel() for p in plain.parameters())
    del plain, optimizer
    model = fresh(dim, blocks, dev)
    unit = 4 * sum(p.numel() for p in model.blocks[0].parameters())  # fp32 bytes of one block's whole parameters
    root = 4 * sum(p.numel() for m in (model.inp, model.head) for p in m.parameters())
    sharded = ShardedModel(model, device=dev, prefetch=prefetch, reductions_in_flight=in_flight)
    shortcut_off(sharded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks, state = [], 0
    for step in range(4 if dry else 20):
        memory.reset()
        F.mse_loss(model(batch(step, dev, 256)[0]), y).backward()
        optimizer.step()
        state = sharded.stats.model_state_bytes([optimizer])["total"]  # shards, their gradients, AdamW state
        optimizer.zero_grad()
        peaks.append(memory.peak())
    # Each gathered unit (the root, the one computing, the prefetched ones): its receive buffer,
    # whole parameters and whole gradients; each reduction in flight: whole gradients and its input.
    units = 3 * (root + unit * (1 + prefetch)) + 2 * unit * in_flight
    bound = state + units + transient + 16 * mib
    steady = peaks[2:]
    peak = f"step peak {max(steady) / mib:.1f} MiB, bound {bound / mib:.1f} MiB"
    report(verdict(max(steady) <= bound, dry), "c", peak)
    report(verdict(max(steady) - min(steady) <= mib, dry), "c", f"peak over steps 3-{len(peaks)}: "
           f"{min(steady) / mib:.1f}-{max(steady) / mib:.1f} MiB (flat: within 1 MiB)")  # fmt: skip
    sharded.restore_module(device="cpu")
    del model, sharded, optimizer
    accelerator = dev.type if dry else "gpu"
    base = memory.allocated()
    lit_trainer(accelerator, ZeRO3Strategy(), max_steps=4).fit(Lit(dim, blocks), loader())
    left = memory.allocated() - base
    report(verdict(left <= mib, dry), "c", f"device memory left after fit: {left / mib:.2f} MiB (near 0: <= 1 MiB)")
    trainer = lit_trainer(accelerator, ZeRO3Strategy(), max_steps=1)
    base = memory.allocated()
    memory.reset()
    with trainer.init_module():
        Lit(dim, blocks)
    built = memory.peak() - base
    report(verdict(built <= mib, dry), "c", f"trainer.init_module() built {built / mib:.1f} MiB on the device (~0)")


# ---- (d) precision x optimizer x clipping ---------------------------------------------------------
def check_d(dry: bool) -> None:
    dev = torch.device("cpu" if dry else "cuda:0")
    precisions = ["bf16-mixed", "16-mixed"]  # on CPU fp16 with a CPU GradScaler (precision_option)
    every = [(fused, clip) for fused in (False, True) for clip in (False, True)]
    variants = [(False, False), (True, False), (True, True)] if FAST else every
    for precision in precisions:
        overflow = 10 if precision == "16-mixed" else None
        for fused, clip in variants:
            name = f"{precision}, {'fused' if fused else 'foreach'} AdamW, clipping {'on' if clip else 'off'}"
            if precision == "16-mixed" and fused and clip:  # Fabric cannot unscale for a fused optimizer
                refused = [_refuses(dev, precision, zero3=z) for z in (False, True)]
                report(verdict(all(refused)), "d", f"{name}: refused as by plain Fabric: {refused}")
                continue
            runs = [fabric_run(dev, precision, zero3=z, fused=fused, clip=clip, overflow_at=overflow)
                    for z in (False, True)]  # fmt: skip
            plain, zero3 = (r["losses"] for r in runs)
            diff = max(abs(a - b) for a, b in zip(plain, zero3)) / max(abs(v) for v in plain)
            report(verdict(diff < 2e-2), "d", f"{name}: max relative loss diff vs plain over 20 steps {diff:.2e}")
            if overflow is not None:
                unchanged, (before, after) = runs[1]["overflow"]["unchanged"], runs[1]["overflow"]["scale"]
                ok = unchanged and after == before / 2
                report(verdict(ok), "d", f"{name}: overflow skipped {unchanged}, scale {before} -> {after}")


def _refuses(dev: torch.device, precision: str, *, zero3: bool) -> bool:
    """Whether clipping a fused optimizer's gradients raises Fabric's NotImplementedError."""
    try:
        fabric_run(dev, precision, zero3=zero3, fused=True, clip=True, steps=1)
    except NotImplementedError:
        return True
    return False


# ---- (e) Lightning --------------------------------------------------------------------------------
class Lit(pl.LightningModule):
    def __init__(self, dim: int = 64, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.losses = Net(dim, blocks), []

    def training_step(self, b: Any, i: int) -> torch.Tensor:
        loss = F.mse_loss(self.net(b[0]).float(), b[1])
        self.losses.append(float(loss))
        return loss

    def validation_step(self, b: Any, i: int) -> None:
        self.log("val_loss", F.mse_loss(self.net(b[0]).float(), b[1]))

    def predict_step(self, b: Any, i: int) -> torch.Tensor:
        return self.net(b[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)  # not AdamW: it would hide a gradient's scale


def loader(batches: int = 8) -> Any:
    xs, ys = zip(*(batch(step, "cpu") for step in range(batches)))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=32)


class ShortcutOff(pl.Callback):
    """The engine the strategy builds runs real collectives from its first batch."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        shortcut_off(trainer.strategy.sharded_model())

    on_validation_start = on_predict_start = on_fit_start


def lit_trainer(accelerator: str, strategy: Any, **kwargs: Any) -> pl.Trainer:
    callbacks = [ShortcutOff()] if isinstance(strategy, ZeRO3Strategy) else []
    options = dict(accelerator=accelerator, devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, max_epochs=4,
                   use_distributed_sampler=False, callbacks=callbacks + kwargs.pop("callbacks", []))  # fmt: skip
    return pl.Trainer(**{**options, **kwargs})


def timed_fit(accelerator: str, strategy: Any, steps: int) -> tuple[float, float | None]:
    """Median step time (s) of a fit, and the GPU's idle fraction over 4 steps in a profiler trace."""
    gpu, times, kernels = accelerator == "gpu", [], []

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if gpu:
                torch.cuda.synchronize()
            if gpu and trainer.global_step == steps - 4:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                self.prof.start()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            if gpu and trainer.global_step == steps:
                self.prof.stop()
                kernels.extend(e.time_range for e in self.prof.events() if e.device_type == DeviceType.CUDA)

    lit_trainer(accelerator, strategy, max_steps=steps, callbacks=[Timer()]).fit(Lit(512, 6), loader(steps))
    if not kernels:
        return statistics.median(times[2:]), None
    kernels.sort(key=lambda r: r.start)
    busy, end = 0.0, kernels[0].start
    for r in kernels:  # the union of kernel intervals
        busy += max(0.0, r.end - max(r.start, end))
        end = max(end, r.end)
    return statistics.median(times[2:]), 1.0 - busy / (end - kernels[0].start)


def check_e(dry: bool) -> None:
    accelerator = "cpu" if dry else "gpu"
    counter = DistCounter()
    counter.install()
    try:
        plain, zero3 = Lit(), Lit()
        lit_trainer(accelerator, "auto", max_steps=4).fit(plain, loader())
        lit_trainer(accelerator, ZeRO3Strategy(), max_steps=4).fit(zero3, loader())
        diff = max(abs(a - b) for a, b in zip(plain.losses, zero3.losses))
        report(verdict(diff < 1e-5), "e", f"fit: max |loss diff| vs plain Trainer {diff:.2e} over 4 steps")
        with tempfile.TemporaryDirectory() as tmp:
            resumed: dict[str, list[float]] = {}
            for kind in ("plain", "sharded") if FAST else ("plain", "sharded", "full"):
                path, again = str(Path(tmp) / kind), Lit()
                strategy = lambda kind=kind: "auto" if kind == "plain" else ZeRO3Strategy(state_dict_type=kind)
                trainer = lit_trainer(accelerator, strategy(), max_steps=4)
                trainer.fit(Lit(), loader())
                trainer.save_checkpoint(path)
                lit_trainer(accelerator, strategy(), max_steps=8).fit(again, loader(), ckpt_path=path)
                resumed[kind] = again.losses
            for kind in [k for k in resumed if k != "plain"]:
                diff = max(abs(a - b) for a, b in zip(resumed[kind], resumed["plain"]))
                ok = diff < 1e-5 and len(resumed[kind]) == 4
                report(verdict(ok), "e", f"{kind} save + resume: max |loss diff| vs plain Trainer {diff:.2e}")
        expected = lit_trainer(accelerator, "auto").validate(Lit(), loader(), verbose=False)[0]["val_loss"]
        got = lit_trainer(accelerator, ZeRO3Strategy()).validate(Lit(), loader(), verbose=False)[0]["val_loss"]
        report(verdict(abs(got - expected) < 1e-5), "e", f"standalone validate: val_loss {got:.6f} vs {expected:.6f}")
        want = torch.cat(lit_trainer(accelerator, "auto").predict(Lit(), loader()))
        have = torch.cat(lit_trainer(accelerator, ZeRO3Strategy()).predict(Lit(), loader()))
        diff = float((want - have).abs().max())
        report(verdict(diff < 1e-5), "e", f"standalone predict: max |output diff| {diff:.2e}")
    finally:
        counter.uninstall()
    count = collectives(counter)
    report(verdict(count > 0), "e", f"{count} collectives at world size 1 (the shortcut was off)")
    steps = 8 if FAST else 24
    (plain_s, plain_idle), (zero3_s, zero3_idle) = (timed_fit(accelerator, s, steps) for s in ("auto", ZeRO3Strategy()))
    idle = "" if dry else f"; GPU idle {zero3_idle or float('nan'):.1%} vs plain {plain_idle or float('nan'):.1%}"
    report("INFO", "e", f"step {zero3_s * 1e3:.1f} ms vs plain {plain_s * 1e3:.1f} ms{idle}")


# ---- (f) offload, reshard, unsynced accumulation ----------------------------------------------
def _settings_run(dev: torch.device, steps: int, no_sync: bool = False, **options: Any) -> dict[str, Any]:
    model = fresh(256, 4, "cpu" if options.get("offload") else dev)
    sharded = ShardedModel(model, device=dev, **options)
    shortcut_off(sharded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    memory = DeviceMemory(dev)
    losses, peak, counted, k = [], 0, -1, 2 if no_sync else 1  # k micro-batches per step
    for step in range(steps):
        x, y = batch(step, dev, 64)
        memory.reset()
        with syncs_counted(dev.type == "cuda" and step == steps - 1) as syncs:
            for micro in range(k):
                with sharded.no_sync() if micro < k - 1 else nullcontext():
                    loss = F.mse_loss(model(x[micro::k]), y[micro::k])
                    (loss / k).backward()
            optimizer.step()
            optimizer.zero_grad()
        sharded.stats.end_step()
        losses.append(loss.detach())
        counted = syncs[0]
        peak = memory.peak()
    psi = sum(p.numel() for p in fresh(256, 4).parameters())
    gathered = sharded.stats.shard_group.last_step["all_gather"].wire_bytes  # this rank's bytes sent in the last step
    return {"losses": torch.stack(losses).tolist(), "syncs": counted, "peak": peak, "psi": psi, "sent": gathered}


def close(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two loss curves."""
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def check_f(dry: bool) -> None:
    dev = torch.device("cpu" if dry else "cuda:0")
    steps = 4 if FAST else 10
    plain = _settings_run(dev, steps)
    run = _settings_run(dev, steps, reshard_after_forward=False)
    report(verdict(run["losses"] == plain["losses"]), "f", "reshard False: losses bitwise equal to the plain run")
    run = _settings_run(dev, steps, offload="host")
    diff = close(run["losses"], plain["losses"])  # CPU AdamW against CUDA AdamW: equal only within rounding
    report(verdict(diff <= TOLERANCE), "f", f"offload host: losses within {diff:.1e} of the plain run (<= {TOLERANCE})")
    # Expected 2: the tag check, and the wait for the gradients' arrival on the host.
    syncs = "-" if dry else run["syncs"]
    report(verdict(run["syncs"] <= 2, dry), "f", f"offload host: {syncs} syncs in a steady step (expected <= 2)")
    saved, state = plain["peak"] - run["peak"], 8 * run["psi"]  # AdamW's fp32 state: 8 bytes per element
    peaks = f"peak {run['peak'] / 2**20:.1f} vs {plain['peak'] / 2**20:.1f} MiB"
    report(verdict(saved >= state, dry), "f", f"offload host: {peaks}, {saved / 2**20:.1f} saved "
           f"(at least AdamW's state, {state / 2**20:.1f})")  # fmt: skip
    halves = [_settings_run(dev, steps, no_sync=True, **o)["losses"] for o in ({}, {"offload": "host"})]
    diff = close(halves[1], halves[0])
    report(verdict(diff <= TOLERANCE), "f", f"unsynced accumulation: offload host within {diff:.1e} of the device run")


# ---- (g) 2 or 4 ranks -----------------------------------------------------------------------------
SETTINGS_G = {"shard_size 1": {"shard_size": 1}, "reshard_after_forward 2": {"reshard_after_forward": 2},
              "reshard_after_forward False": {"reshard_after_forward": False}, "offload host": {"offload": "host"}}


def _two_rank_run(rank: int, world: int, device: str) -> dict[str, dict]:
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    steps = 4 if FAST else 10
    return {name: _settings_run(dev, steps, **options) for name, options in {"default": {}, **SETTINGS_G}.items()}


def check_g(dry: bool) -> None:
    if not two_ranks(dry):
        report("INFO", "g", f"2 ranks need 2 GPUs; {torch.cuda.device_count()} present: not run")
        return
    device, backend = ("cpu", "gloo") if dry else ("cuda", "nccl")
    world = 4 if dry or torch.cuda.device_count() >= 4 else 2  # reshard_after_forward=2 keeps slices at 4 only
    runs = run_ranks(_two_rank_run, world, device, backend=backend)[0]
    base = runs["default"]
    sent = f"All-Gather on {world} ranks: {base['sent']} bytes sent by rank 0 in a step"
    report(verdict(base["sent"] > 0), "g", sent)
    for name in SETTINGS_G:
        diff = close(runs[name]["losses"], base["losses"])
        report(verdict(diff <= TOLERANCE), "g", f"{name}: losses within {diff:.1e} of the default (<= {TOLERANCE})")


# ---- (h) one GPU: a Llama-like model -------------------------------------------------------------
class LlamaBlock(nn.Module):
    """RMSNorm, causal attention, RMSNorm, SwiGLU MLP (no rotary embedding: it costs the same)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.heads, hidden = max(1, dim // 128), 11 * dim // 4  # 2048: 16 heads, MLP 5632
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.gate_up, self.down = nn.Linear(dim, 2 * hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, T, d / heads)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(attended)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, dim: int, blocks: int, vocab: int) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(vocab, dim), nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.blocks = nn.ModuleList(LlamaBlock(dim) for _ in range(blocks))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def llama_sizes(dry: bool) -> dict[str, int]:  # 8 blocks of hidden 2048 at sequence 2048, bf16
    return dict(dim=32, blocks=4, vocab=64, seq=16, batch=2) if dry else dict(dim=2048, blocks=8, vocab=8192,
                                                                                seq=2048, batch=4)  # fmt: skip


def pooled_bytes(sharded: ShardedModel) -> int:
    """Bytes the engine's buffer pool keeps (its API may change: read here only)."""
    return sharded._pool.cached_bytes


class LlamaRun:
    """One model trained step by step, sharded (bf16 gathers) or plain, on `dev`."""

    def __init__(self, dev: torch.device, sizes: dict[str, int], *, zero3: bool = True, **options: Any) -> None:
        torch.manual_seed(0)
        home = "cpu" if options.get("offload") else dev
        with torch.device(home):
            self.model = Llama(sizes["dim"], sizes["blocks"], sizes["vocab"])
        self.sharded = ShardedModel(self.model, device=dev, param_dtype=torch.bfloat16, **options) if zero3 else None
        if self.sharded is not None:
            shortcut_off(self.sharded)
        else:
            self.model.to(torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        shape = (sizes["batch"], sizes["seq"] + 1)
        self.tokens = torch.randint(0, sizes["vocab"], shape, generator=g).to(dev)  # on the device before any count
        self.dev, self.vocab = dev, sizes["vocab"]

    def step(self) -> None:
        logits = self.model(self.tokens[:, :-1])
        F.cross_entropy(logits.float().view(-1, self.vocab), self.tokens[:, 1:].reshape(-1)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def timed_steps(self, count: int) -> float:
        """Median seconds of `count` steps (host syncs between them, none inside)."""
        times, memory = [], DeviceMemory(self.dev)
        for _ in range(count):
            memory.reset()  # synchronizes on CUDA
            start = time.perf_counter()
            self.step()
            memory.peak()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def steady_syncs(self) -> int:
        for _ in range(2):  # the first records the order, the second is the first to follow it
            self.step()
        with syncs_counted(self.dev.type == "cuda") as syncs:
            self.step()
        return syncs[0]


@contextmanager
def gathers_delayed(on: bool, cycles: int) -> Iterator[None]:
    """`torch.cuda._sleep` on the issuing stream before each All-Gather: latency prefetch must hide."""
    original = dist.all_gather_single

    def delayed(*args: Any, **kwargs: Any) -> Any:
        torch.cuda._sleep(cycles)
        return original(*args, **kwargs)

    dist.all_gather_single = delayed if on else original
    try:
        yield
    finally:
        dist.all_gather_single = original


def sleep_cycles(ms: float) -> int:
    """`torch.cuda._sleep` cycles that take about `ms` on this GPU (timed once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(1_000_000 * ms / start.elapsed_time(end))


def sanitized_step(dry: bool) -> int:
    """`--sanitize-step`, run in a subprocess under TORCH_CUDA_SANITIZER=1 (on CPU: the stand-in):
    a small Llama trained two steps, with offload too; exit 1 on a race."""
    dev = torch.device("cpu" if dry else "cuda:0")
    ensure_group(dev)
    sizes = dict(llama_sizes(True), dim=256, seq=128) if not dry else llama_sizes(True)
    with standin() if dry else nullcontext() as mode:
        for options in ({}, {"offload": "host"}):
            run = LlamaRun(dev, sizes, **options)
            run.step()
            run.step()
    races = mode.races if mode is not None else []
    print(f"races: {races[:3]}")
    return 1 if races else 0


def check_h(dry: bool) -> None:
    dev, sizes, mib, n = torch.device("cpu" if dry else "cuda:0"), llama_sizes(dry), 2**20, 1 if dry else 5
    shape = f"{sizes['blocks']} blocks, hidden {sizes['dim']}, sequence {sizes['seq']}"
    plain = LlamaRun(dev, sizes, zero3=False)
    plain_syncs, plain_s = plain.steady_syncs(), plain.timed_steps(n)
    del plain
    gc.collect()
    run = LlamaRun(dev, sizes)
    syncs = run.steady_syncs()
    report(verdict(syncs <= plain_syncs, dry), "h", f"{shape}: {syncs} syncs in a steady step (plain model "
           f"{plain_syncs}); step {run.timed_steps(n) * 1e3:.1f} ms vs plain {plain_s * 1e3:.1f} ms")  # fmt: skip
    memory, step_pool = DeviceMemory(dev), pooled_bytes(run.sharded)
    for name in ("gathered_for_inference()", "full_state_dict()"):
        resting = memory.allocated()
        memory.reset()
        if name == "full_state_dict()":
            run.sharded.full_state_dict().clear()  # host tensors, dropped
        else:
            with run.sharded.gathered_for_inference(), torch.no_grad():
                run.model(run.tokens[:1, :-1])
        pooled, kept = pooled_bytes(run.sharded), memory.allocated() - resting
        report(verdict(pooled <= step_pool and kept <= mib, dry), "h", f"after {name} mid-fit: pool {pooled / mib:.1f} "
               f"MiB (a step's {step_pool / mib:.1f}), {kept / mib:.1f} MiB more allocated, peak "
               f"{memory.peak() / mib:.0f} MiB")  # fmt: skip
        run.step()
    del run
    gc.collect()
    cycles = 1 if dry else sleep_cycles(1.0)  # below a block's forward (~2 ms): prefetch can hide it
    added = {}
    for prefetch in (1, 0):  # the extra step time the delays cost, with prefetch and without
        run = LlamaRun(dev, sizes, prefetch=prefetch)
        run.step()
        plain_s = run.timed_steps(n)
        with gathers_delayed(not dry, cycles):
            run.step()
            added[prefetch] = run.timed_steps(n) - plain_s
        del run
        gc.collect()  # module<->hook cycles hold the device memory until a collection
    hidden = 1 - added[1] / added[0] if added[0] > 0 else float("nan")
    report(verdict(hidden >= 0.8, dry), "h", f"1 ms before each All-Gather: {hidden:.0%} hidden by prefetch=1 "
           f"(+{added[1] * 1e3:.1f} ms a step; prefetch=0 +{added[0] * 1e3:.1f} ms)")  # fmt: skip
    run = LlamaRun(dev, dict(sizes, dim=sizes["dim"] // 2, blocks=4), offload="host")
    rows = []
    for _ in range(3):
        run.step()
        rows.append([(s.row.data_ptr(), s.row.is_pinned()) for kept in run.sharded._offload._staging.values()
                     for s in kept])  # fmt: skip
    reused, pinned = rows[1] == rows[2] and bool(rows[2]), all(p for _, p in rows[2])
    report(verdict(reused and (pinned or dry)), "h", f"offload host: {len(rows[2])} gradient staging rows, the same "
           f"each step: {reused}, pinned: {pinned}; {run.steady_syncs()} syncs in a steady step")  # fmt: skip
    del run
    env = dict(os.environ, **({} if dry else {"TORCH_CUDA_SANITIZER": "1"}))
    command = [sys.executable, __file__, "--sanitize-step"] + (["--dry-run"] if dry else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    name = "the CPU stand-in" if dry else "TORCH_CUDA_SANITIZER=1"
    report(verdict(done.returncode == 0), "h", f"2 steps under {name} (subprocess): exit {done.returncode}; "
           f"{(done.stdout + done.stderr).strip()[-600:]}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run the same code on CPU/gloo")
    parser.add_argument("--only", default="abcdefgh", help="which checks, e.g. 'ae'")
    parser.add_argument("--fast", action="store_true", help="one variant per check (the test suite's run)")
    parser.add_argument("--sanitize-step", action="store_true", help="(h)'s subprocess: two steps, exit 1 on a race")
    args = parser.parse_args(argv)
    if args.sanitize_step:
        return sanitized_step(args.dry_run)
    global FAST
    FAST = args.fast
    RESULTS.clear()
    if not args.dry_run and not torch.cuda.is_available():
        print("No CUDA device: run with --dry-run for the CPU version of these checks.")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    start = time.perf_counter()
    ensure_group(torch.device("cpu" if args.dry_run else "cuda:0"))  # world size 1, reused by Lightning and Fabric
    checks = {"a": check_a, "b": check_b, "c": check_c, "d": check_d, "e": check_e, "f": check_f, "g": check_g,
              "h": check_h}  # fmt: skip
    for key in args.only:
        try:
            checks[key](args.dry_run)
        except Exception as err:  # noqa: BLE001 - one broken check must not hide the others
            report("FAIL", key, f"crashed: {type(err).__name__}: {str(err)[-600:]}")
    if dist.is_initialized():
        dist.destroy_process_group()
    failed = RESULTS.count("FAIL")
    mode = "dry run on CPU" if args.dry_run else torch.cuda.get_device_name()
    print(f"{len(RESULTS) - failed}/{len(RESULTS)} without failure ({mode}, {time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
