"""Cost of averaging the persistent parameters' gradients at the end of each backward.

    PYTHONPATH=. python benchmarks/persistent_grads.py --ranks 2 --layers 8 --dim 512 --steps 30

Every parameter of a stack of `layers` Linear(dim, dim) is kept whole (`persistence_threshold`
above their size), so the All-Reduce of persistent gradients carries the whole model. For both
kinds of `zero_grad` it prints, on rank 0, the median time of `reduce_persistent_grads` (called
by the engine when backward ends), the bytes one call allocates (new storage returned by the
aten ops it runs), and the bytes of persistent gradients that moved since the step before.
Run it from outside the checkout with another checkout first on PYTHONPATH to compare (the
rank processes put the working directory first on their path).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_zero3.engine import ShardedModel
from tests.ranks import run_ranks


class _NewMemory(TorchDispatchMode):
    """Bytes of the tensors that ops return on storage none of their inputs had: new memory
    (views, in-place and `out=` ops return their inputs' storage). Private torch API, for this
    measurement only; tried on torch 2.13."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def _measure(rank: int, world_size: int, layers: int, dim: int, steps: int, set_to_none: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
    sharded = ShardedModel(model, persistence_threshold=dim * dim)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    timings: list[float] = []
    allocated: list[int] = []
    reduce = sharded.reduce_persistent_grads

    def timed() -> None:
        if len(timings) == steps // 2 and not allocated:  # one step counted, not timed
            with _NewMemory() as new:
                reduce()
            allocated.append(new.bytes)
            return
        start = time.perf_counter()
        reduce()
        timings.append(time.perf_counter() - start)

    sharded.reduce_persistent_grads = timed  # type: ignore[method-assign]
    x = torch.randn(16, dim)
    moved_bytes, before = [], None
    for _ in range(steps):
        model(x).square().mean().backward()
        where = [p.grad.data_ptr() for p in sharded.persistent]
        if before is not None:
            moved_bytes.append(sum(p.grad.numel() * 4 for p, a, b in zip(sharded.persistent, where, before) if a != b))
        before = where
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return {
        "median_ms": 1000 * statistics.median(timings[3:]),
        "moved_bytes": statistics.median(moved_bytes),
        "allocated_bytes": allocated[0],
        "persistent_bytes": sum(p.numel() * 4 for p in sharded.persistent),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    for set_to_none in (False, True):
        result = run_ranks(_measure, args.ranks, args.layers, args.dim, args.steps, set_to_none)[0]
        print(
            f"zero_grad(set_to_none={set_to_none}): reduce_persistent_grads median {result['median_ms']:.2f} ms, "
            f"allocates {result['allocated_bytes'] / 2**20:.1f} MiB per call, "
            f"gradients at new addresses per step {result['moved_bytes'] / 2**20:.1f} MiB "
            f"of {result['persistent_bytes'] / 2**20:.1f} MiB persistent"
        )


if __name__ == "__main__":
    main()
