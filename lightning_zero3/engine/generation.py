"""Hugging Face `generate()` on a sharded model: keep the ranks in step by default.

[Note: synced generation by default]
Outside `gathered_for_inference()` every rank must call the model equally often, but HF's `generate()`
stops on a rank whose sequences ended unless `synced_gpus=True` (which HF sets itself only for DeepSpeed
and FSDP): the others would wait in a gather until the timeout. (docs/design.md, synced generation by
default)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn


def synced_default(kwargs: dict[str, Any], *, kept: bool, world_size: int) -> dict[str, Any]:
    """`kwargs` with `synced_gpus=True` filled in where it is due."""
    if kwargs.get("synced_gpus") is None and not kept and world_size > 1:
        return {**kwargs, "synced_gpus": True}
    return kwargs


class SyncedGenerate:
    """Note: synced generation by default."""

    def __init__(self, module: nn.Module, kept: Callable[[], bool]) -> None:
        self.module = module
        self.kept = kept

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        kwargs = synced_default(kwargs, kept=self.kept(), world_size=world_size)
        return type(self.module).generate(self.module, *args, **kwargs)  # type: ignore[attr-defined]


def install_synced_generate(root: nn.Module, kept: Callable[[], bool], *, ranks: int) -> list[nn.Module]:
    """Give every HF model under `root` a synced `generate`; the modules changed."""
    if not dist.is_initialized() or ranks != dist.get_world_size() or ranks < 2:
        return []
    changed = []
    for module in root.modules():
        if callable(getattr(type(module), "generate", None)) and hasattr(module, "generation_config"):
            if "generate" not in vars(module):  # a user's own instance attribute is left alone
                setattr(module, "generate", SyncedGenerate(module, kept))  # noqa: B010 - an instance attribute over the method
                changed.append(module)
    return changed


def remove_synced_generate(modules: list[nn.Module]) -> None:
    for module in modules:
        if isinstance(vars(module).get("generate"), SyncedGenerate):
            del module.generate
    modules.clear()
