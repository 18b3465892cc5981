"""What one save costs each rank (docs/checkpoints.md, "Measured"): the time training is blocked
and the peak host memory added (VmHWM growth over the RSS before the save), for a sharded, a full,
an asynchronous (`async_save`) and a remote (S3) save, at 2 ranks, of `tests.models.TinyGPT`
(vocab 8192, dim 768, 6 layers: 48.8 M parameters, fp32, AdamW after one step: 586 MiB of state).

    PYTHONPATH=. python benchmarks/checkpoint_costs.py DIR

writes under DIR; the remote saves go to moto's S3 server, started here on 127.0.0.1 (needs the
test extra: s3fs, moto[server]).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.measure import peak_rss_bytes, reset_peak_rss
from lightning_zero3 import ShardedModel
from lightning_zero3.checkpoint.remote import as_path
from lightning_zero3.core import ShardedRun
from lightning_zero3.options import LightningOptions
from tests.models import TinyGPT
from tests.ranks import run_ranks

SHAPE = {"vocab": 8192, "dim": 768, "heads": 12, "depth": 6, "context": 512}
MiB = 2**20


KINDS = {  # kind -> (state_dict_type, path under DIR or URL, async_save)
    "sharded": ("sharded", "sharded", False),
    "full": ("full", "full.ckpt", False),
    "async sharded": ("sharded", "async", True),
    "remote sharded": ("sharded", "s3://bench/sharded", False),
    "remote full": ("full", "s3://bench/full.ckpt", False),
}


def _costs(rank: int, world_size: int, directory: str, env: dict[str, str], kind: str) -> tuple[float, float, float]:
    """(seconds blocked, seconds until written, MiB of peak host memory added) of one save, in a
    fresh process (memory an earlier save freed would hide this one's growth)."""
    os.environ.update(env)
    torch.manual_seed(0)
    model = TinyGPT(**SHAPE)
    engine = ShardedModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, SHAPE["vocab"], (1, 9))
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    state_dict_type, path, background = KINDS[kind]
    options = LightningOptions(state_dict_type=state_dict_type)
    run = ShardedRun(engine, lambda: options)
    dist.barrier()
    before = reset_peak_rss()
    start = time.perf_counter()
    checkpoint: dict[str, Any] = {
        "state_dict": run.model_state_dict(),
        "optimizer_states": [run.optimizer_state(optimizer)],
    }
    run.save(as_path(path if "://" in path else os.path.join(directory, path)), checkpoint, None, background=background)
    del checkpoint
    blocked = time.perf_counter() - start
    run.wait_for_save()
    written = time.perf_counter() - start
    return blocked, written, (peak_rss_bytes() - before) / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    args = parser.parse_args()
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
    try:
        for kind in KINDS:
            results = run_ranks(_costs, 2, args.directory, env, kind, timeout_s=600)
            cells = [
                f"rank {r}: blocked {b:.2f} s, written {w:.2f} s, +{m:.0f} MiB" for r, (b, w, m) in enumerate(results)
            ]
            print(f"{kind:15s} " + "; ".join(cells), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
