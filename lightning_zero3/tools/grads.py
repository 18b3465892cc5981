"""Gradient norms of the whole gradients under ZeRO-3 (`lightning.pytorch.utilities.grad_norm`
would see this rank's shards): the same keys as Lightning's utility, the same values on every
rank from one All-Reduce, so every rank must call it. Fabric: `fabric.strategy.grad_norm`."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_zero3.common.base import ShardedStrategy
from lightning_zero3.engine import ShardedModel, grad_norms


def sharded_grad_norm(
    sharded: ShardedModel, module: nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, Tensor]:
    """Lightning's `grad_norm(module, norm_type)` dictionary for `module`'s parameters (a model
    sharded by `sharded`, or a submodule of it), computed on the whole gradients."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    # The engine sets every rank's shard gradients together: each rank passes the same list.
    named = [(name, p) for name, p in module.named_parameters() if p.grad is not None]
    if not named:
        return {}
    each, total = grad_norms(sharded, [p for _, p in named], norm_type)
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": each[i] for i, (name, _) in enumerate(named)}
    norms[f"grad_{norm_type}_norm_total"] = total
    return norms


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """`lightning.pytorch.utilities.grad_norm` for a LightningModule trained with
    `ZeRO3Strategy`: the norms of the whole gradients, not of this rank's shards. Under any
    other strategy it is Lightning's own utility."""
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    if not isinstance(strategy, ShardedStrategy):
        # Lightning annotates dict[str, float] but returns tensors (lightning 2.5-2.6).
        return lightning_grad_norm(module, norm_type, group_separator)  # type: ignore[return-value]
    return sharded_grad_norm(strategy.sharded_model(), module, norm_type, group_separator)
