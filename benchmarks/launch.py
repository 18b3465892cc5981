"""Start N rank processes joined in one process group, run a function in each, return results.
Processes come from a forkserver that imported torch, Lightning and the benchmark once: a launch
costs a fraction of a second after the first, and every run is a fresh process (peak RSS per run)."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from tests.support.ranks import call_in_group, collect_results, report

_PRELOAD = ["torch", "lightning.pytorch", "lightning_zero3", "benchmarks.backends"]


def _entry(rank: int, world_size: int, store_path: str, backend: str, threads: int, fn: Callable, args: tuple,
           queue: Any) -> None:  # fmt: skip
    os.environ["OMP_NUM_THREADS"] = str(threads)

    def work() -> Any:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300),
                                **kwargs)  # fmt: skip
        return call_in_group(fn, rank, world_size, args)

    report(queue, rank, work)


@functools.cache
def _mp_context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def run_ranks(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", threads: int = 1,
              timeout_s: float = 1800) -> list[Any]:  # fmt: skip
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return their results in rank order."""
    ctx = _mp_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(rank, world_size, store_path, backend, threads, fn, args, queue))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        return collect_results(procs, queue, timeout_s)
