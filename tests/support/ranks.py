"""Launch real ranks on CPU with gloo and re-raise their failures in the test.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` processes
joined by a gloo process group over a FileStore, with a short collective timeout so a hang fails
the test. Each rank's return value comes back in a list; a rank's exception is re-raised with
its traceback under a `--- rank k ---` header. Processes come from a forkserver that has
imported torch once, so a launch costs ~0.1 s after the first.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60


class RankFailure(AssertionError):
    pass


def _entry(
    rank: int, world_size: int, store_path: str, timeout_s: float, fn: Callable, args: tuple, queue: Any
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    def work() -> Any:
        import torch

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        # Every rank connected before any starts: a rank whose `fn` returns at once (a check
        # that raises before any collective) would otherwise leave the group while a slower
        # one is still connecting ("Gloo connectFullMesh failed" under load).
        dist.barrier()
        return call_in_group(fn, rank, world_size, args)

    report(queue, rank, work)


def call_in_group(fn: Callable, rank: int, world_size: int, args: tuple) -> Any:
    """`fn(rank, world_size, *args)`, then leave the process group whatever happened."""
    try:
        return fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def report(queue: Any, rank: int, work: Callable[[], Any]) -> None:
    """Run `work()` in a rank process and put (rank, ok, pickled result or traceback) on `queue`,
    what `collect_results` reads. Results go by value: tensors sent as shared memory would die
    with this process."""
    try:
        result = work()
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as err:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


_context: Any = None


def _mp_context() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        support = ["tests.support.ranks", "tests.support.models", "tests.support.adapted"]
        preload = ["torch", "lightning.pytorch", "lightning_zero3", *support]
        # The tests that launch Lightning's ranks (tests/support/adapted.py), whose modules and callbacks
        # those ranks unpickle; the Hugging Face models some send; s3fs, which Lightning's
        # `_atomic_save` imports at a rank's first save (0.5 s, each launch hands weights back so).
        root = Path(__file__).parents[1]  # tests/
        tests = root.rglob("test_*.py")
        preload += sorted(
            ".".join(path.relative_to(root.parent).with_suffix("").parts)
            for path in tests
            if "from tests.support.adapted import" in path.read_text()
        )
        preload += [name for name in ("transformers", "peft", "s3fs") if importlib.util.find_spec(name) is not None]
        _context.set_forkserver_preload(preload)
    return _context


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return their results."""
    ctx = _mp_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(rank, world_size, store_path, timeout_s, fn, args, queue))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        return collect_results(procs, queue, timeout_s * 3 + 30)


def run_ranks_while_one_dies(fn: Any, *args: Any, survivor: int = 0, timeout_s: float = 30) -> Any:
    """Like run_ranks at 2 ranks, but only `survivor` is expected to report (the other exits)."""
    ctx = _mp_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, 2, store, timeout_s, fn, args, queue)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            rank, ok, value = queue.get(timeout=timeout_s + 30)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    assert rank == survivor and ok, value
    return pickle.loads(value)


def collect_results(procs: list[Any], queue: Any, timeout_s: float) -> list[Any]:
    """Wait for each started rank process to put (rank, ok, pickled result or traceback) on
    `queue`; return the results in rank order, or raise `RankFailure` with every failed rank's
    traceback under a `--- rank k ---` header. A rank that dies without reporting (e.g. gloo
    aborting the process) fails the run at once, with its exit code, not at the deadline. The
    processes are joined (killed if still running) before returning; a rank that reported and
    then exited with a code other than 0 fails the run too."""
    world_size = len(procs)
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = queue.get(timeout=0.5)
                results[rank] = (ok, value)
                continue
            except queue_module.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
            if dead and queue.empty():
                time.sleep(1.0)  # let the survivors report the error they saw
                while not queue.empty():
                    rank, ok, value = queue.get()
                    results[rank] = (ok, value)
                for r in dead:
                    results.setdefault(r, (False, f"process exited with code {procs[r].exitcode} without reporting"))
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    failures = [f"--- rank {r} ---\n{value}" for r, (ok, value) in sorted(results.items()) if not ok]
    # A rank that reported and then died at exit (issue 22.9: gloo's worker thread aborting the
    # process while Python finalizes; a rank still alive 10 s after reporting was killed above).
    failures += [
        f"--- rank {r} ---\nreported, then exited with code {p.exitcode} (0 expected: a collective or process "
        "group still alive at exit?)"
        for r, p in enumerate(procs)
        if results.get(r, (False, None))[0] and p.exitcode != 0
    ]
    if failures:
        raise RankFailure("\n".join(failures))
    return [pickle.loads(results[r][1]) for r in range(world_size)]
