"""Optimizer state on disk (`ShardingConfig(offload="host", offload_dir=...)`).

[Note: optimizer state on disk]
After every optimizer step on this model's shards, each shard-shaped state tensor (Adam's
moments; not "step", not persistent parameters') still in anonymous memory moves into a
file-backed shared map (`torch.from_file(..., shared=True)`) that replaces the state entry; the
optimizer then updates it in place through the page cache, which the kernel writes back and can
drop (RssFile, not RssAnon). Files around the step would hold the whole state in memory during
it; a map keeps the pages in use. Files are made by `tempfile.mkstemp` in the user's directory
and unlinked at once: the kernel frees them with the last tensor on the map, even if the
process is killed. Costs: the first step holds the state in anonymous memory once; the directory
must be on a real disk (on tmpfs the "file" is RAM again).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_zero3.engine.buffers import release_freed_heap
from lightning_zero3.engine.shard import ShardedParam

__all__ = ["DiskState"]

# Each tensor on a map starts at a multiple of this many bytes (every dtype's alignment).
_ALIGN = 64


class DiskState:
    """Note: optimizer state on disk."""

    def __init__(self, directory: str, *, rank: int, lookup: Callable[[torch.Tensor], ShardedParam | None]) -> None:
        self.directory = directory
        self.prefix = f"zero3-optimizer-state-rank{rank}-"
        self._lookup = lookup
        self.files = 0  # files made
        self._handle = register_optimizer_step_post_hook(self._after_step)

    def close(self) -> None:
        """Stop moving state; the maps live as long as the tensors on them."""
        self._handle.remove()

    def on_disk(self, tensor: torch.Tensor) -> bool:
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
            release_freed_heap()

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
