"""Save and load times of a GPT-2-small-shaped model (docs/checkpoints.md, "Measured"): a sharded
save and a full save (gathered to rank 0) at 2 ranks, then sharded loads at 2, 1 and 3 ranks
(model and AdamW state, resliced), for `tests.models.TinyGPT` with vocab 50257, dim 768, 12
layers, 12 heads, context 1024 (124,439,808 parameters, fp32, AdamW after one step).

    PYTHONPATH=. python benchmarks/checkpoint_times.py DIR [--small]

writes DIR/gpt.ckpt (the sharded directory, ~1.4 GiB) and DIR/full.ckpt; `--small` uses the
default TinyGPT (7,312 parameters) instead. The times are the disk's and the machine's load.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_zero3 import ShardedModel
from lightning_zero3 import checkpoint as C
from lightning_zero3.engine.state import full_optimizer_state
from tests.models import TinyGPT
from tests.ranks import run_ranks

GPT2_SMALL = {"vocab": 50257, "dim": 768, "heads": 12, "depth": 12, "context": 1024}


def _build(seed: int, small: bool) -> tuple[torch.nn.Module, ShardedModel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT() if small else TinyGPT(**GPT2_SMALL)
    sharded = ShardedModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, model.wte.num_embeddings, (1, 9))
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    optimizer.step()  # AdamW state exists from here
    optimizer.zero_grad()
    return model, sharded, optimizer


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _save(rank: int, world_size: int, directory: str, small: bool) -> tuple[float, float]:
    model, sharded, optimizer = _build(0, small)

    def sharded_save() -> None:
        state = {"state_dict": model.state_dict(), "optimizer_states": [C.sharded_optimizer_state(sharded, optimizer)]}
        C.save_sharded(f"{directory}/gpt.ckpt", sharded, state)

    def full_save() -> None:
        state = {
            "state_dict": sharded.full_state_dict(to_rank=0),
            "optimizer_states": [full_optimizer_state(sharded, optimizer, to_rank=0)],
        }
        C.save_full(state, f"{directory}/full.ckpt", sharded.world_comm)

    return _timed(sharded_save), _timed(full_save)


def _load(rank: int, world_size: int, directory: str, small: bool) -> float:
    model, sharded, optimizer = _build(1, small)
    return _timed(lambda: C.load_sharded(f"{directory}/gpt.ckpt", sharded, optimizers=[optimizer]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--small", action="store_true", help="the default TinyGPT (7,312 parameters)")
    args = parser.parse_args()
    sharded_s, full_s = run_ranks(_save, 2, args.directory, args.small, timeout_s=600)[0]
    print(f"save at 2 ranks: sharded {sharded_s:.2f} s, full {full_s:.2f} s")
    for n in (2, 1, 3):
        seconds = run_ranks(_load, n, args.directory, args.small, timeout_s=600)[0]
        print(f"sharded load at N = {n}: {seconds:.2f} s")


if __name__ == "__main__":
    main()
