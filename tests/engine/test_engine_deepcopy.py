"""`copy.deepcopy` of a module while it is sharded (an EMA teacher made in `on_fit_start`, say)
is refused with an explanation on every rank (pickling it too): its parameters are this rank's shards and its hooks
belong to the engine, whose process group cannot be copied (before: "cannot pickle
'ProcessGroup' object" from deep inside `copy`, on 2+ ranks only). Once the module is whole
again, it copies as any module does."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from lightning_zero3.engine import ShardedModel
from tests.support.models import MLP
from tests.support.ranks import run_ranks


def _deepcopy_while_sharded_then_whole(rank: int, world_size: int) -> dict[str, str]:
    torch.manual_seed(0)
    model = MLP()
    sharded = ShardedModel(model)
    try:
        copy.deepcopy(model)
        refused = ""
    except TypeError as err:
        refused = str(err)
    try:
        pickle.dumps(model)
        pickle_refused = ""
    except TypeError as err:
        pickle_refused = str(err)
    sharded.restore_module(device=torch.device("cpu"))
    whole = copy.deepcopy(model)
    return {
        "refused": refused,
        "pickle_refused": pickle_refused,
        "whole_shapes": str([tuple(p.shape) for p in whole.parameters()]),
    }


@pytest.fixture(scope="module")
def copied() -> list[dict]:
    """Each rank's outcomes of `_deepcopy_while_sharded_then_whole` (one run, two tests)."""
    return run_ranks(_deepcopy_while_sharded_then_whole, 2)


def test_deepcopy_of_a_sharded_module_is_refused_with_the_fix_on_every_rank(copied: list[dict]) -> None:
    for result in copied:
        assert "deep-copied" in result["refused"] and "before" in result["refused"], result["refused"]
        assert result["whole_shapes"] == str([tuple(p.shape) for p in MLP().parameters()])


def test_pickling_a_sharded_module_is_refused_with_the_fix_on_every_rank(copied: list[dict]) -> None:
    """`torch.save(model)` / `torch.save(trainer)` inside a rank (the module at rest after `fit`):
    the engine's message, not "cannot pickle 'ProcessGroup' object" from inside pickle."""
    for result in copied:
        assert "cannot be pickled" in result["pickle_refused"], result["pickle_refused"]
        assert "full_state_dict" in result["pickle_refused"], result["pickle_refused"]
