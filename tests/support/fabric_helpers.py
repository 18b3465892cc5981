"""Fabric started as users start it, `launch(fn)`: `fabric.launch(fn)` with Fabric's own
multiprocessing launcher; Fabric on `run_ranks` ranks, `fabric(rank, world_size)`, for a test that
needs each rank's view; and the single-process reference Fabric runs are compared with.

On `run_ranks` ranks, each rank sets the variables a launcher like torchrun sets (tests/support/lit.py):
Fabric's launcher then runs in place and reuses the process group `run_ranks` initialised."""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.support import models
from tests.support.lit import become_lightning_rank
from tests.support.parity import local_slice, no_decay_for_biases_and_norms
from tests.support.ranks import _mp_context

LR = 0.01


def fabric(rank: int, world_size: int, strategy: Any = "zero3", **kwargs: Any) -> Any:
    """A launched Fabric for this rank."""
    import lightning as L

    import lightning_zero3  # noqa: F401 - registers "zero3"

    become_lightning_rank(rank, world_size)
    f = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy, **kwargs)
    f.launch()
    return f


def launch(fn: Callable[..., Any], *args: Any, devices: int = 2, precision: Any = None, **options: Any) -> Any:
    """`Fabric(strategy=ZeRO3FabricStrategy(**options), devices=devices).launch(fn, *args)`:
    `fn(fabric, *args)` on ranks started by Fabric's multiprocessing launcher from the forkserver
    of tests/support/ranks.py (torch and Lightning preloaded: a launch costs well under a second), with a
    collective timeout so that a hang fails the test. Returns rank 0's return value, as Fabric
    does; an exception on any rank fails the launch (torch's ProcessRaisedException).

    Rank 0's value comes back pickled in a file, not through Fabric's queue: the launcher reads
    the queue only after every rank has exited, so a value over a pipe's 64 KiB blocks rank 0 in
    `put` forever, and a CPU tensor (sent as shared memory, by a file descriptor of the rank) is
    gone by then (FileNotFoundError). Both happen under DDP too (Lightning 2.6)."""
    import lightning as L

    from lightning_zero3 import ZeRO3FabricStrategy

    _mp_context()  # the forkserver's preload is set before it starts
    options.setdefault("timeout", timedelta(seconds=60))
    strategy = ZeRO3FabricStrategy(start_method="forkserver", **options)
    launched = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank0.pkl"
        launched.launch(_into_file, str(path), fn, *args)
        return pickle.loads(path.read_bytes())


def _into_file(fabric: Any, path: str, fn: Callable[..., Any], *args: Any) -> None:
    result = fn(fabric, *args)
    if fabric.global_rank == 0:
        Path(path).write_bytes(pickle.dumps(result))


def every_rank(value: Any) -> list[Any]:
    """Each rank's `value`, in rank order, on every rank (pickled): what a launched function
    returns for the test to check every rank's view, as `run_ranks` gives it."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(no_decay_for_biases_and_norms(model), lr=LR)


def train_step(
    fabric: Any, model: nn.Module, optimizer: Any, step: int, rank: int, world_size: int, clip: float | None
) -> tuple[float, float | None]:
    """One step on this rank's slice of global batch `step`; (mean loss over ranks, grad norm)."""
    x, y = models.mlp_batch(step)
    loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
    fabric.backward(loss)
    norm = fabric.clip_gradients(model, optimizer, max_norm=clip) if clip is not None else None
    optimizer.step()
    optimizer.zero_grad()
    return float(fabric.all_reduce(loss.detach())), None if norm is None else float(norm)


def reference(steps: int, clip: float | None = None, first: int = 0) -> tuple[nn.Module, list[tuple[float, Any]]]:
    """One process training `models.MLP()` (seed 0) on the whole global batches."""
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = adamw(model)
    out = []
    for step in range(first, first + steps):
        x, y = models.mlp_batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
        optimizer.step()
        optimizer.zero_grad()
        out.append((float(loss.detach()), None if norm is None else float(norm)))
    return model, out


def full_state(fabric: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    return fabric.strategy.sharded_model(model).full_state_dict(to_rank=None)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"state dict keys differ: {sorted(a.keys() ^ b.keys())}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
