"""`ShardedEMAWeightAveraging` / `ShardedWeightAveraging` (lightning_zero3/tools/averaging.py) under
zero3 give the weights Lightning's `EMAWeightAveraging` / `WeightAveraging` give under DDP: after
fit (the average copied into the model) and while validating (the average swapped in); and a
run resumed from a sharded checkpoint at another world size continues the average exactly. On the
gloo harness (tests/support/ranks.py): a multiprocessing launcher pickles the callbacks to its ranks, and
Lightning's EMAWeightAveraging, the reference, holds a local function, which no pickle takes (ours
pickle: the last test)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging

from tests.support.lit import LitMLP, become_lightning_rank, loader, max_difference, trainer, whole_state
from tests.support.ranks import run_ranks

TOL = 1e-5


class _Validated(LitMLP):
    """Logs each validation loss, computed with the weights the callback swapped in."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.val_losses: list[float] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(float(self.trainer.strategy.reduce(F.mse_loss(self(x), y))))


def _callback(kind: str, sharded: bool) -> Any:
    from lightning_zero3 import ShardedEMAWeightAveraging, ShardedWeightAveraging

    if kind == "ema":
        return ShardedEMAWeightAveraging(decay=0.7) if sharded else EMAWeightAveraging(decay=0.7)
    return ShardedWeightAveraging() if sharded else WeightAveraging()


def _fit(rank: int, world_size: int, strategy: str, kind: str) -> dict[str, Any]:
    become_lightning_rank(rank, world_size)
    import lightning_zero3  # noqa: F401 - registers "zero3"

    torch.manual_seed(0)
    model = _Validated()
    callback = _callback(kind, sharded=strategy == "zero3")
    t = trainer(strategy, world_size, max_epochs=2, val_check_interval=2, callbacks=[callback])
    t.fit(model, loader(world_size), loader(world_size))
    return {"val_losses": model.val_losses, "state": whole_state(model)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_averaging_on_shards_gives_lightnings_averaged_weights_under_ddp(kind: str) -> None:
    ddp = run_ranks(_fit, 2, "ddp", kind)[0]
    for zero3 in run_ranks(_fit, 2, "zero3", kind):
        assert len(zero3["val_losses"]) == len(ddp["val_losses"]) == 16  # 4 validations of 4 batches
        assert max(abs(a - b) for a, b in zip(zero3["val_losses"], ddp["val_losses"])) < TOL
        assert max_difference(zero3["state"], ddp["state"]) < TOL


def _fit_saving_after_epoch_1(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    become_lightning_rank(rank, world_size)
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero3 import ShardedEMAWeightAveraging, ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP(lr=0.05)
    saver = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)  # after each epoch
    callbacks = [ShardedEMAWeightAveraging(decay=0.7), saver]
    t = trainer(ZeRO3Strategy(), world_size, max_epochs=2, callbacks=callbacks, enable_checkpointing=True)
    t.fit(model, loader(world_size))
    return whole_state(model)


def _resume(rank: int, world_size: int, path: str, kind: str) -> dict[str, Any]:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ShardedEMAWeightAveraging, ZeRO3Strategy

    torch.manual_seed(1)  # other weights: everything must come from the checkpoint
    model = LitMLP(lr=0.05)
    strategy = ZeRO3Strategy()
    strategy.lightning_options = dataclasses.replace(strategy.lightning_options, state_dict_type=kind)
    t = trainer(strategy, world_size, max_epochs=2, callbacks=[ShardedEMAWeightAveraging(decay=0.7)])
    t.fit(model, loader(world_size), ckpt_path=path)
    return whole_state(model)


@pytest.mark.slow
def test_the_average_resumes_exactly_from_a_sharded_checkpoint_at_another_world_size(tmp_path: Path) -> None:
    """A checkpoint written during fit after the first of 2 epochs at 2 ranks (the average is in
    the optimizer state: tools/averaging.py, Note: averages in the optimizer state), resumed at 3 ranks:
    the final averaged weights equal those of the run that went on."""
    uninterrupted = run_ranks(_fit_saving_after_epoch_1, 2, str(tmp_path))[0]
    for resumed in run_ranks(_resume, 3, str(tmp_path / "epoch=0.ckpt"), "sharded"):
        assert max_difference(resumed, uninterrupted) < TOL


@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_the_averaging_callbacks_pickle_as_a_spawning_launcher_sends_them(kind: str) -> None:
    callback = _callback(kind, sharded=True)
    copy = pickle.loads(pickle.dumps(callback))
    assert vars(copy).keys() == vars(callback).keys()
    assert getattr(copy, "decay", None) == getattr(callback, "decay", None)
