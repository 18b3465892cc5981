"""Optimizer state on disk (`ShardingConfig(offload="host", offload_dir=...)`).

[Note: optimizer state on disk]
After every optimizer step that steps this model's shards, each state tensor shaped like a
shard (Adam's moments, SGD's momentum; not the "step" counters, not the state of persistent
parameters) that is still in anonymous memory is moved into a file-backed shared memory map
(`torch.from_file(..., shared=True)`, MAP_SHARED), and the optimizer's state entry is replaced by
the tensor on the map. The optimizer then updates the state in place, through the page cache:
the kernel writes dirty pages back to the file and can drop them under memory pressure, so the
state needs disk, not RAM; it is counted in RssFile, not RssAnon. Chosen over reading and
writing files around the step: the optimizer steps on all its parameters in one call, so
explicit reads would hold the whole state in memory during every step, where a map lets the
kernel keep only the pages in use. A state replaced later (`optimizer.load_state_dict`, a
checkpoint load) is moved at the end of the next step.
Files: one per move (usually one per rank: the first step creates all state), named uniquely by
`tempfile.mkstemp` in the user's directory (so runs sharing a directory never meet), mapped and
then unlinked at once: the directory shows nothing, nothing is written outside it, and the
kernel frees the blocks when the last tensor on the map dies, at teardown or when the process
ends, even if it is killed. Costs: torch optimizers create their state inside their first step,
so that step holds it in anonymous memory once before the move (as on a resume before the first
step); the directory must be on a real disk (on tmpfs the "file" is RAM again).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_zero3.engine.shard import ShardedParam

__all__ = ["DiskState"]

# Each tensor on a map starts at a multiple of this many bytes (every dtype's alignment).
_ALIGN = 64


class DiskState:
    """Moves the shard-shaped optimizer state of `shards` into files under `directory` after
    every step of an optimizer that holds them (Note: optimizer state on disk)."""

    def __init__(self, directory: str, *, rank: int, lookup: Callable[[torch.Tensor], ShardedParam | None]) -> None:
        self.directory = directory
        self.prefix = f"zero3-optimizer-state-rank{rank}-"
        self._lookup = lookup
        self.files = 0  # files made, for tests and the benchmark
        self._handle = register_optimizer_step_post_hook(self._after_step)

    def close(self) -> None:
        """Stop moving state (teardown). The maps live as long as the tensors on them."""
        self._handle.remove()

    def on_disk(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on a map of one of this object's files."""
        name = tensor.untyped_storage().filename
        return name is not None and os.path.basename(name).startswith(self.prefix)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        moves = []
        for param, state in optimizer.state.items():
            sharded = self._lookup(param)
            if sharded is None:
                continue
            for key, value in state.items():
                if sharded.is_shard_shaped(value) and not self.on_disk(value):
                    moves.append((state, key, value))
        if moves:
            self._move(moves)
            del moves  # the last references to the anonymous copies
            _release_freed_heap()

    def _move(self, moves: list[tuple[dict, Any, torch.Tensor]]) -> None:
        sizes = [-(-v.numel() * v.element_size() // _ALIGN) * _ALIGN for _, _, v in moves]
        fd, path = tempfile.mkstemp(prefix=self.prefix, dir=self.directory)
        try:
            os.ftruncate(fd, sum(sizes))
            raw = torch.from_file(path, shared=True, size=sum(sizes), dtype=torch.uint8)
        finally:
            os.unlink(path)
            os.close(fd)
        self.files += 1
        offset = 0
        with torch.no_grad():
            for (state, key, value), size in zip(moves, sizes):
                nbytes = value.numel() * value.element_size()
                on_disk = raw[offset : offset + nbytes].view(value.dtype)
                on_disk.copy_(value.detach())
                state[key] = on_disk
                offset += size


def _release_freed_heap() -> None:
    """Give the pages of freed heap blocks back to the kernel (glibc's `malloc_trim`; elsewhere
    nothing). The state moved out was allocated in the step, in blocks glibc keeps in its heap
    once freed (below its mmap threshold, which rises to the size of the largest block freed),
    so without this RssAnon keeps them: measured on the 20m GPT, 2 ranks, the drop against the
    in-memory run was 43 MiB of 73 (docs/accounting.md, Offload)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
