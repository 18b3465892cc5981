"""`ShardedParam`: one parameter's sharded bookkeeping.

[Note: shard layout]
A parameter is flattened and cut into N pieces of `shard_numel = ceil(numel / N)`, the last
padded with zeros; rank r keeps piece r as a 1-D `nn.Parameter` under the original name. The
padding stays zero: a zero with a zero gradient stays zero under element-wise optimizers.

[Note: shards in one buffer]
One unit's shards live back to back in one buffer, in gather-row order, allocated before any
whole tensor (materialize.py). Each is a tensor of its own on it (`set_`, not a slice), with its
own version counter, so writing one shard does not make the others look changed.

[Note: whole inside gathered_parameters]
`param` holds this rank's shard except inside `gathered_parameters` (gathered.py), which puts the
whole data in it and pushes the block's `modifier_rank` on `gathered` (None: writes are dropped on
exit), popped on exit. During forward the whole tensors only shadow `param` (hooks.py, Note: one
unit call), so `gathered` empty means `param`, what `state_dict()` reads, is a shard. The
strategies' state-dict guard (common/run.py) reads it.

[Note: shard writes]
Writes to shards that no version counter shows (`.data.copy_`, fused optimizer kernels, DCP's
loads) are counted instead: every `torch.optim` optimizer's step (a global post-step hook,
public), `load_whole`, the checkpoint loads. Caches of what shards hold (quantize.py, Note: packed
once per change) compare the count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

_writes = 0  # Note: shard writes


def note_shard_writes(*_: object) -> None:
    """Shards may have changed (Note: shard writes); any arguments (an optimizer hook's) ignored."""
    global _writes
    _writes += 1


def shard_writes() -> int:
    return _writes


register_optimizer_step_post_hook(note_shard_writes)


def shard_numel(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size)


def tensors_in_one_row(
    numels: list[int], row_numel: int, dtype: torch.dtype, device: torch.device, *, pin: bool = False
) -> list[torch.Tensor]:
    """Tensors of `numels` elements back to back in one new buffer (Note: shards in one buffer)."""
    storage = torch.empty(row_numel, dtype=dtype, device=device, pin_memory=pin).untyped_storage()
    tensors, offset = [], 0
    for numel in numels:
        tensors.append(torch.empty(0, dtype=dtype, device=device).set_(storage, offset, (numel,), (1,)))
        offset += numel
    return tensors


def one_row(tensors: Sequence[torch.Tensor | None], offsets: list[int], numel: int) -> torch.Tensor | None:
    """A 1-D view of `numel` elements over the storage `tensors` lie in, each at its offset from
    the view's start (None entries skipped); None where they do not lie so (Note: shards in one
    buffer: moved off it by a `.data` replaced)."""
    placed = [(t, o) for t, o in zip(tensors, offsets) if t is not None]
    if not placed:
        return None
    first, start = placed[0]
    base = first.storage_offset() - start
    storage = first.untyped_storage()
    if base < 0 or (base + numel) * first.element_size() > storage.nbytes():
        return None
    for t, o in placed:
        if (
            t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.storage_offset() != base + o
            or not t.is_contiguous()
            or t.dtype != first.dtype
        ):
            return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, base, (numel,), (1,))


def shard_slice(whole: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's padded 1-D piece of `whole` (a new tensor)."""
    flat = whole.detach().reshape(-1)
    size = shard_numel(flat.numel(), world_size)
    piece = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    start = min(rank * size, flat.numel())
    end = min(start + size, flat.numel())
    piece[: end - start].copy_(flat[start:end])
    return piece


@dataclass(eq=False)
class ShardedParam:
    """One parameter that is kept as a shard and gathered whole for compute."""

    owners: list[tuple[nn.Module, str]]  # every (module, attribute) holding it (tied weights)
    names: list[str]  # qualified names under the root
    whole_shape: torch.Size
    param: nn.Parameter  # the registered 1-D shard
    world_size: int
    rank: int
    numel: int = field(init=False)
    shard_numel: int = field(init=False)
    # The modifier_rank of each `gathered_parameters` block holding `param` whole, innermost last
    # (Note: whole inside gathered_parameters).
    gathered: list[int | None] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.numel = math.prod(self.whole_shape)
        self.shard_numel = shard_numel(self.numel, self.world_size)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad

    def valid_numel(self) -> int:
        """Elements of this rank's shard that are not padding."""
        return max(0, min(self.shard_numel, self.numel - self.rank * self.shard_numel))

    def is_shard_shaped(self, value: object) -> bool:
        """Whether `value` is laid out like the shard (per-element optimizer state)."""
        return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == self.shard_numel

    def load_whole(self, whole: torch.Tensor) -> None:
        """Overwrite this rank's shard from a whole tensor."""
        if whole.numel() != self.numel:
            raise ValueError(
                f"Parameter '{self.name}' has shape {tuple(self.whole_shape)} but the tensor given has "
                f"shape {tuple(whole.shape)}; load a state dict of the same model."
            )
        with torch.no_grad():
            piece = shard_slice(whole, self.rank, self.world_size)  # slice first: no whole-tensor copy
            self.param.data.copy_(piece)  # casts to the shard's dtype and device
        note_shard_writes()
