"""A setup that fails is reported with its own error: the strategy's teardown after the failure
must not raise a second error of its own that hides the first. On the gloo harness's ranks
(tests/support/ranks.py), not the launcher's: it reads the error of every rank, and Lightning's launcher
re-raises only the first failed rank's (torch's ProcessRaisedException) and terminates the others."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.lit import LitMLP, become_lightning_rank, loader, trainer
from tests.support.ranks import run_ranks


class _NoReset(nn.Module):
    """A module whose own parameter has no `reset_parameters()` (as Hugging Face's `Conv1D`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(7, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _BuiltInConfigureModel(LitMLP):
    def configure_model(self) -> None:
        self.net = nn.Sequential(_NoReset(), nn.Linear(5, 5))  # on the meta device under zero3


def _fit_built_on_meta_without_reset(rank: int, world_size: int) -> str:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    try:
        trainer(ZeRO3Strategy(), world_size, max_steps=1).fit(_BuiltInConfigureModel(), loader(world_size))
    except Exception as err:  # noqa: BLE001 - the test looks at which error came out
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_module_that_cannot_be_initialised_on_meta_fails_with_its_own_error_on_every_rank() -> None:
    for message in run_ranks(_fit_built_on_meta_without_reset, 2):
        assert message.startswith("ValueError: _NoReset has tensors ['weight']"), message
        assert "param_init_fn" in message, message
