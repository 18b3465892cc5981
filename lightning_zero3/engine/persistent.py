"""`PersistentGrads`: the gradients of parameters kept whole on every rank, averaged after each backward.

[Note: persistent gradients in one buffer]
One flat buffer per dtype and device is All-Reduced, followed by one element per parameter counting the
ranks that produced its gradient: one no rank used keeps `grad=None`, as in one process.
(docs/design.md, persistent gradients in one buffer)
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from lightning_zero3.engine.comm import Comm

__all__ = ["PersistentGrads"]


class _Bucket:
    """The trainable persistent parameters of one dtype and device, and their flat buffer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.flat: weakref.ref[torch.Tensor] | None = None

    def views_in_place(self) -> torch.Tensor | None:
        """The buffer, if every parameter's `.grad` is still its view at its place; else None."""
        flat = self.flat() if self.flat is not None else None
        if flat is None:
            return None
        base, offset = flat.data_ptr(), 0
        for p in self.params:
            g = p.grad
            if (
                g is None
                or g._base is not flat
                or g.data_ptr() != base + offset * flat.element_size()
                or g.shape != p.shape
                or not g.is_contiguous()
            ):
                return None
            offset += p.numel()
        return flat


class PersistentGrads:
    """Note: persistent gradients in one buffer."""

    def __init__(self, params: list[nn.Parameter], comm: Comm) -> None:
        self.params = params
        self.comm = comm
        self._key: tuple[int, ...] = ()  # the trainable parameters `_buckets` were made for
        self._buckets: list[_Bucket] = []
        self.copies = 0  # reductions that took the copy path

    def _buckets_for(self, params: list[nn.Parameter]) -> list[_Bucket]:
        """Kept while the set of trainable parameters holds."""
        key = tuple(id(p) for p in params)
        if key != self._key:
            by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
            for p in params:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
            self._key, self._buckets = key, [_Bucket(group) for group in by_kind.values()]
        return self._buckets

    def reduce(self) -> None:
        """Average the gradients over the ranks; collective."""
        params = [p for p in self.params if p.requires_grad]
        if not params or self.comm.world_size == 1:
            return
        for bucket in self._buckets_for(params):
            self._reduce(bucket)

    def _reduce(self, bucket: _Bucket) -> None:
        params, k = bucket.params, len(bucket.params)
        flat = bucket.views_in_place()
        in_place = flat is not None
        if flat is None:
            self.copies += 1
            like = params[0]
            flat = torch.empty(bucket.numel + k, dtype=like.dtype, device=like.device)
            zero = flat.new_zeros(())  # a missing gradient: zeros, not allocated per parameter
            parts = [p.grad.reshape(-1) if p.grad is not None else zero.expand(p.numel()) for p in params]
            with torch.no_grad():
                torch.cat(parts, out=flat[: bucket.numel])
        with torch.no_grad():
            counts = flat[bucket.numel :]
            counts.fill_(1)  # this rank produced every gradient, but ...
            missing = [i for i, p in enumerate(params) if p.grad is None]
            for i in missing:
                counts[i].zero_()  # ... these (one small kernel each, off the steady state)
            self.comm.all_reduce(flat, what="gradients of persistent parameters")
            used = (counts > 0).tolist() if missing else [True] * k  # the only host read
            flat[: bucket.numel].div_(self.comm.world_size)
        bucket.flat = weakref.ref(flat)
        if in_place:
            return  # every `.grad` is a view of `flat` already
        offset = 0
        for p, is_used in zip(params, used):
            p.grad = flat[offset : offset + p.numel()].view_as(p) if is_used else None
            offset += p.numel()
