"""Hugging Face `generate()` on a sharded model: keep the ranks in step by default.

[Note: synced generation by default]
Outside `gathered_for_inference()`, every forward gathers every unit, so every rank must call
the model the same number of times. HF's `generate()` stops calling it on a rank whose
sequences all reached EOS, unless `synced_gpus=True`, which HF turns on by itself only for
DeepSpeed ZeRO-3 and torch FSDP (held.py says why the engine does not pose as FSDP). Code
written for DDP, where ranks never wait for each other while generating, then leaves the ranks
still generating waiting in a gather until the collective timeout (30 minutes by default under
the Trainer), and the hint in that error comes only then.

So the engine gives each HF model under it (a module with `generate` and `generation_config`)
a `generate` that fills in `synced_gpus=True` when the caller left it unset, the context is not
active and there is more than one rank: HF then All-Reduces one flag per token, a small cost
next to the per-token gathers. What the caller passes wins; inside `gathered_for_inference()`
nothing is filled in (no collective runs per token there, and one rank may generate alone).
HF's flag travels on the default process group, so this applies only when the engine's ranks
are the whole world. The method is set on the instance and removed by `restore_module` and
`leave_sharded`, leaving an ordinary module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn


def synced_default(kwargs: dict[str, Any], *, held: bool, world_size: int) -> dict[str, Any]:
    """`kwargs` of a `generate()` call with `synced_gpus=True` filled in where it is due."""
    if kwargs.get("synced_gpus") is None and not held and world_size > 1:
        return {**kwargs, "synced_gpus": True}
    return kwargs


class SyncedGenerate:
    """The `generate` the engine puts on an HF model's instance (Note: synced generation by default)."""

    def __init__(self, module: nn.Module, held: Callable[[], bool]) -> None:
        self.module = module
        self.held = held

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        kwargs = synced_default(kwargs, held=self.held(), world_size=world_size)
        return type(self.module).generate(self.module, *args, **kwargs)  # type: ignore[attr-defined]


def install_synced_generate(root: nn.Module, held: Callable[[], bool], *, ranks: int) -> list[nn.Module]:
    """Give every HF model under `root` a synced `generate` when the engine's `ranks` are the
    whole default group; return the modules changed (for `remove_synced_generate`)."""
    if not dist.is_initialized() or ranks != dist.get_world_size() or ranks < 2:
        return []
    changed = []
    for module in root.modules():
        if callable(getattr(type(module), "generate", None)) and hasattr(module, "generation_config"):
            if "generate" not in vars(module):  # a user's own instance attribute is left alone
                setattr(module, "generate", SyncedGenerate(module, held))  # noqa: B010 - an instance attribute over the method
                changed.append(module)
    return changed


def remove_synced_generate(modules: list[nn.Module]) -> None:
    for module in modules:
        if isinstance(vars(module).get("generate"), SyncedGenerate):
            del module.generate
    modules.clear()
