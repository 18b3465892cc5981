"""What checkpoints cost (docs/checkpoints.md, "Measured"): per kind of save at 2 ranks, the time
training is blocked, the time until written and the peak host memory added (VmHWM growth over the
RSS before it); the sharded load at 2, 1 and 3 ranks; reading the sharded checkpoint in one process
(`load_checkpoint`, `load_from_checkpoint`, `consolidate` as call and command, and torch's
`dcp_to_torch_save` for comparison). `tests.support.models.TinyGPT` (48.8 M parameters, fp32, AdamW after
one step: 586 MiB of state) in a LightningModule; every figure from fresh processes.

    PYTHONPATH=. python benchmarks/checkpoint_costs.py DIR [--parts save,load,plain]  # or e.g. sharded,plain

writes under DIR; the remote saves go to moto's S3 server on 127.0.0.1 (the test extra).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import runpy
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import lightning_zero3
from benchmarks.measure import peak_rss_bytes, reset_peak_rss
from lightning_zero3 import ShardedModel
from lightning_zero3.checkpoint import load_sharded
from lightning_zero3.common.options import LightningOptions
from lightning_zero3.common.run import ShardedRun
from tests.support.models import TinyGPT
from tests.support.ranks import run_ranks

SHAPE = {"vocab": 8192, "dim": 768, "heads": 12, "depth": 6, "context": 512}
MiB = 2**20

SAVES = {  # kind -> (state_dict_type, path under DIR or URL, async_save)
    "sharded": ("sharded", "sharded", False),
    "full": ("full", "full.ckpt", False),
    "async sharded": ("sharded", "async", True),
    "remote sharded": ("sharded", "s3://bench/sharded", False),
    "remote full": ("full", "s3://bench/full.ckpt", False),
}


class LitGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(**SHAPE)


def _trained(seed: int) -> tuple[LitGPT, ShardedModel, torch.optim.Optimizer]:
    """A sharded model and its AdamW after one step (the optimizer state exists)."""
    torch.manual_seed(seed)
    model = LitGPT()
    engine = ShardedModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, SHAPE["vocab"], (1, 9))
    F.cross_entropy(model.gpt(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, engine, optimizer


def _save(rank: int, world_size: int, directory: str, env: dict[str, str], kind: str) -> tuple[float, float, float]:
    """(seconds blocked, seconds until written, MiB of peak host memory added) of one save."""
    os.environ.update(env)
    _, engine, optimizer = _trained(0)
    state_dict_type, path, background = SAVES[kind]
    options = LightningOptions(state_dict_type=state_dict_type, async_save=background)
    run = ShardedRun(engine, lambda: options)
    dist.barrier()
    before = reset_peak_rss()
    start = time.perf_counter()
    checkpoint: dict[str, Any] = {"state_dict": run.model_state_dict(), "pytorch-lightning_version": pl.__version__,
                                  "optimizer_states": [run.optimizer_state(optimizer)]}  # fmt: skip
    run.save(path if "://" in path else os.path.join(directory, path), checkpoint, None)
    del checkpoint
    blocked = time.perf_counter() - start
    run.wait_for_save()
    written = time.perf_counter() - start
    return blocked, written, (peak_rss_bytes() - before) / MiB


def _load(rank: int, world_size: int, directory: str) -> tuple[float, float]:
    """(seconds, MiB of peak host memory added) of loading the sharded save, optimizer included."""
    _, engine, optimizer = _trained(1)
    dist.barrier()
    before = reset_peak_rss()
    start = time.perf_counter()
    load_sharded(os.path.join(directory, "sharded"), engine, optimizers=[optimizer])
    dist.barrier()
    return time.perf_counter() - start, (peak_rss_bytes() - before) / MiB


def _plain(what: str, directory: str) -> tuple[float, float]:
    """(seconds, MiB of peak host memory added) of reading the sharded save in one process."""
    path, out = os.path.join(directory, "sharded"), os.path.join(directory, "consolidated.ckpt")
    calls: dict[str, Callable[[], object]] = {
        "load_checkpoint": lambda: lightning_zero3.load_checkpoint(path),
        "load_from_checkpoint": lambda: lightning_zero3.load_from_checkpoint(LitGPT, path, strict=False),
        "consolidate (call)": lambda: lightning_zero3.consolidate_checkpoint(path, out),
        "dcp_to_torch_save": lambda: dcp_to_torch_save(path, out),  # the whole state in memory, then torch.save
        # As `python -m lightning_zero3 consolidate` runs it (it sets glibc's mmap threshold).
        "consolidate (command)": lambda: (
            setattr(sys, "argv", ["lightning_zero3", "consolidate", path, out]),
            runpy.run_module("lightning_zero3", run_name="__main__"),
        ),
    }
    before = reset_peak_rss()
    start = time.perf_counter()
    try:
        calls[what]()
    except SystemExit as exit:
        assert not exit.code, exit.code
    return time.perf_counter() - start, (peak_rss_bytes() - before) / MiB


def _in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _s3_server() -> tuple[Any, dict[str, str]]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    return server, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--parts", default="save,load,plain", help="of save (or one kind of save), load, plain")
    args = parser.parse_args()
    parts = args.parts.split(",")
    saves = [kind for kind in SAVES if "save" in parts or kind in parts]
    if saves:
        server, env = _s3_server()
        try:
            for kind in saves:
                results = run_ranks(_save, 2, args.directory, env, kind, timeout_s=600)
                cells = [f"rank {r}: blocked {b:.2f} s, written {w:.2f} s, +{m:.0f} MiB" for r, (b, w, m) in
                         enumerate(results)]  # fmt: skip
                print(f"save {kind:15s} " + "; ".join(cells), flush=True)
        finally:
            server.stop()
    if "load" in parts:
        for n in (2, 1, 3):
            results = run_ranks(_load, n, args.directory, timeout_s=600)
            cells = [f"rank {r}: {s:.2f} s, +{m:.0f} MiB" for r, (s, m) in enumerate(results)]
            print(f"sharded load at N = {n}: " + "; ".join(cells), flush=True)
    if "plain" in parts:
        for what in ("load_checkpoint", "load_from_checkpoint", "consolidate (call)", "consolidate (command)",
                     "dcp_to_torch_save"):  # fmt: skip
            seconds, added = _in_fresh_process(_plain, what, args.directory)
            print(f"one process, {what}: {seconds:.2f} s, +{added:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
