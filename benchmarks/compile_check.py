"""`torch.compile` under ZeRO-3 next to DDP: graphs, graph breaks, recompiles, step time.

    python benchmarks/compile_check.py                       # backend aot_eager: counts, ~2 min
    python benchmarks/compile_check.py --backend inductor    # step times with generated kernels

The GPT of benchmarks/model.py (preset `--size`, default "1m": 4 blocks, width 128, Ψ ≈ 0.8M)
trains `--steps` SGD steps on 2 gloo ranks (one thread each), in a fresh pair of processes per
variant:

- ddp-whole:      `torch.compile(DistributedDataParallel(model))`;
- ddp-blocks:     `block.compile()` on each transformer block, then DDP;
- zero3-whole:    `ShardedModel(model)`, then `model.compile()` (what `self.model.compile()` in
                  `configure_model` and Fabric's re-compile after `setup` do);
- zero3-wrapped:  `ShardedModel(torch.compile(model))` (`self.model = torch.compile(self.model)`);
- zero3-blocks:   `block.compile()` on each block (FSDP2's advice).

Each process also trains the variant's eager twin (DDP, or ShardedModel, not compiled) from the
same seed, step for step in alternating order, so that both see the same machine load:
"/eager" is the median of the per-step time ratios after `--warmup` steps, "first s" the
compiled step 0 (compilation included), "loss diff" the largest loss difference from the twin.
Times are the slowest rank's. Counted on rank 0, by a backend that wraps `--backend`: graphs
compiled (recompiles included); from dynamo's counters and logs (private, this is a measurement
script): graph breaks with their reasons, recompiles and "hit config.recompile_limit" warnings.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from benchmarks.launch import run_ranks  # noqa: E402
from benchmarks.model import build_model, lm_loss, make_batches, make_config, window_length  # noqa: E402
from tests.ranks import RankFailure  # noqa: E402

VARIANTS = ("ddp-whole", "ddp-blocks", "zero3-whole", "zero3-wrapped", "zero3-blocks")


class CountingBackend:
    """A dynamo backend that counts the graphs it is given, then hands them to `backend`."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.graphs = 0
        self.ops: list[int] = []  # operations per graph, in compile order

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        self.ops.append(sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")))
        if self.backend == "eager":
            return gm.forward
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


class DynamoLog(logging.Handler):
    """Collects dynamo's recompilation messages and its "hit config.recompile_limit" warnings."""

    def __init__(self) -> None:
        super().__init__()
        self.recompiles: list[str] = []
        self.limit_hits: list[str] = []
        torch._logging.set_logs(recompiles=True)
        recompiles = logging.getLogger("torch._dynamo.guards.__recompiles")
        recompiles.propagate = False
        recompiles.addHandler(self)
        logging.getLogger("torch._dynamo.convert_frame").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Recompiling"):
            self.recompiles.append(message.splitlines()[0])
        elif "recompile_limit" in message:
            self.limit_hits.append(" ".join(message.split()[:12]))


def dynamo_counts(log: DynamoLog) -> dict[str, Any]:
    """Graph breaks (by reason), recompiles and recompile-limit hits so far in this process."""
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return {
        "breaks": sum(breaks.values()),
        "break_reasons": sorted(breaks.items(), key=lambda kv: -kv[1])[:6],
        "recompiles": len(log.recompiles),
        "recompiled": sorted(set(log.recompiles))[:6],
        "limit_hit": len(log.limit_hits),
        "limit_messages": log.limit_hits[:3],
        "stats": dict(counters["stats"]),
        "frames": dict(counters["frames"]),
    }


def prepare(variant: str, model: torch.nn.Module, backend: CountingBackend) -> torch.nn.Module:
    """The module the step calls, built as `variant` says (see the module docstring)."""
    from lightning_zero3.engine import ShardedModel

    kind, how = variant.split("-")
    if how == "blocks":
        for block in model.h:
            block.compile(backend=backend)
    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return torch.compile(ddp, backend=backend) if how == "whole" else ddp
    if how == "wrapped":
        wrapped = torch.compile(model, backend=backend)
        ShardedModel(wrapped)
        return wrapped
    ShardedModel(model)
    if how == "whole":
        model.compile(backend=backend)
    return model


def timed_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """One SGD step; returns (the slowest rank's seconds, the loss)."""
    dist.barrier()
    start = time.perf_counter()
    loss = lm_loss(net, x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), float(loss.detach())


def train(rank: int, world_size: int, variant: str, size: str, steps: int, batch: int, backend_name: str) -> dict:
    """Train `variant` and, step for step in alternating order, its eager twin (the same kind,
    not compiled), so that both see the same load; the twin gives the eager time and losses."""
    torch._dynamo.reset()
    log = DynamoLog()
    backend = CountingBackend(backend_name)
    windows, vocab = make_batches(
        block_size=window_length(size), batch_size=batch, world_size=world_size, steps=steps, seed=0
    )  # (steps, N, B, T + 1)
    kind = variant.split("-")[0]
    nets = {
        "compiled": prepare(
            variant, build_model(make_config(size, vocab), seed=0, device=torch.device("cpu")), backend
        ),
        "eager": prepare(
            f"{kind}-eager", build_model(make_config(size, vocab), seed=0, device=torch.device("cpu")), backend
        ),
    }
    optimizers = {name: torch.optim.SGD(net.parameters(), lr=0.1) for name, net in nets.items()}
    times: dict[str, list[float]] = {"compiled": [], "eager": []}
    losses: dict[str, list[float]] = {"compiled": [], "eager": []}
    for step in range(steps):
        x, y = windows[step, rank, :, :-1].contiguous(), windows[step, rank, :, 1:].contiguous()  # (B, T) each
        for name in ("compiled", "eager") if step % 2 else ("eager", "compiled"):
            seconds, loss = timed_step(nets[name], optimizers[name], x, y)
            times[name].append(seconds)
            losses[name].append(loss)
    return {"times": times, "losses": losses, "graphs": backend.graphs, "ops": backend.ops, **dynamo_counts(log)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1m")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--backend", default="aot_eager", help="eager, aot_eager or inductor")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if not v.endswith("-eager")))
    parser.add_argument("--verbose", action="store_true", help="print dynamo's frame and stats counters")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average before: {' '.join(f.read().split()[:3])}")
    print(f"torch {torch.__version__}, size {args.size}, backend {args.backend}, 2 gloo ranks, {args.steps} steps")
    results, failed = {}, {}
    for variant in args.variants.split(","):
        try:
            results[variant] = run_ranks(
                train, 2, variant, args.size, args.steps, args.batch, args.backend, timeout_s=1800
            )[0]
        except RankFailure as err:  # reported in the table, the other variants still run
            failed[variant] = next(line for line in str(err).splitlines() if line and not line.startswith("---"))
    print(
        f"{'variant':14} {'graphs':>6} {'breaks':>6} {'recomp':>6} {'limit':>5} {'first s':>8} {'eager s':>7}"
        f" {'step s':>7} {'/eager':>6} {'loss diff':>9}"
    )
    for variant, r in results.items():
        compiled, eager = r["times"]["compiled"], r["times"]["eager"]
        ratio = statistics.median(c / e for c, e in zip(compiled[args.warmup :], eager[args.warmup :]))
        diff = max(abs(a - b) for a, b in zip(r["losses"]["compiled"], r["losses"]["eager"]))
        print(
            f"{variant:14} {r['graphs']:6d} {r['breaks']:6d} {r['recompiles']:6d} {r['limit_hit']:5d}"
            f" {compiled[0]:8.3f} {statistics.median(eager[args.warmup :]):7.3f}"
            f" {statistics.median(compiled[args.warmup :]):7.3f} {ratio:6.2f} {diff:9.2e}"
        )
        if r["break_reasons"]:
            for reason, count in r["break_reasons"]:
                print(f"    {count:3d} x {reason[:150]!r}")
        for message in r["limit_messages"]:
            print(f"    limit: {message}")
        if args.verbose:
            for message in r["recompiled"]:
                print(f"    {message}")
            print(f"    ops per graph {r['ops']}\n    frames {r['frames']}\n    stats {r['stats']}")
    for variant, error in failed.items():
        print(f"{variant:14} failed: {error[:200]}")
    with open("/proc/loadavg") as f:
        print(f"load average after: {' '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
