"""A sharded checkpoint (the default, a directory) loads into a plain module in one process, with
no process group (Note: loading into a plain module): `lightning_zero3.load_checkpoint` gives the
Lightning checkpoint dict with whole tensors, `lightning_zero3.load_from_checkpoint` a
LightningModule built from its hyper-parameters, as `LightningModule.load_from_checkpoint` does for
a file. Adapted from Lightning's `test_running_test_pretrained_model_distrib_ddp_spawn`
(tests_pytorch/models/test_restore.py): 2 ranks fit with `ModelCheckpoint`, then the best model
is loaded in this process and predicts what the strategy predicts from the same checkpoint. The
Trainer runs are started by the strategy's launcher (tests/support/adapted.py `launched`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_zero3
from lightning_zero3 import CheckpointError
from lightning_zero3.checkpoint.full import read_full_file
from lightning_zero3.checkpoint.trust import read_dcp_index
from tests.checkpoint.test_checkpoint_trust import craft
from tests.support.adapted import HandsBack, launched
from tests.support.checkpoints import save_mlp
from tests.support.lit import LitMLP, dataset, loader, trainer, whole_state


class HparamsMLP(LitMLP):
    """LitMLP whose constructor arguments are saved as hyper-parameters."""

    def __init__(self, lr: float = 0.01, note: str = "default") -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


class CountingCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that counts its saves on this rank (as Lightning's
    ModelCheckpointTestInvocations does) and, from `setup` to `teardown`, the calls of torch.save
    (counted as Lightning's tests count them): `saves`, the type of what each saved."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.on_save_checkpoint_count = 0

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._patch = mock.patch("torch.save", wraps=torch.save)
        self._save_mock = self._patch.start()

    @property
    def saves(self) -> list[str]:
        return [type(call.args[0]).__name__ for call in self._save_mock.call_args_list]

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._patch.stop()
        super().teardown(trainer, pl_module, stage)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self.on_save_checkpoint_count += 1


class Predicted(pl.Callback):
    """What a predict run gives, in `callback_metrics` (which the launcher hands back from rank
    0; under a launcher `predict` returns no predictions): "predictions", this rank's batches'
    outputs; at the end of the run (after the strategy's teardown, as a script reads it after
    the call returns), "state", the module's weights whole, read the user's way."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.outputs.append(outputs)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.callback_metrics["predictions"] = self.outputs

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.callback_metrics["state"] = whole_state(pl_module)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank fit; the sharded best checkpoint and what the strategy predicts from it."""
    torch.manual_seed(0)
    model = HparamsMLP(lr=0.02, note="trained")
    checkpoint = CountingCheckpoint(dirpath=tmp_path_factory.mktemp("plain"), monitor="val_loss", save_top_k=1)
    hands_back = HandsBack(
        checkpoints="checkpoint_callback.on_save_checkpoint_count", saves="checkpoint_callback.saves"
    )
    fit = trainer(launched("zero3"), 2, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoint, hands_back])
    fit.fit(model, loader(2), loader(2))
    predict = trainer(
        launched("zero3"), 2, callbacks=[Predicted(), HandsBack(predictions="callback_metrics.predictions")]
    )
    predict.predict(model, DataLoader(dataset(), batch_size=8), ckpt_path=checkpoint.best_model_path)
    # Predict's DistributedSampler (no shuffle) gives rank r the samples r, r + 2, ...
    predictions = torch.stack([torch.cat(rank) for rank in predict.callback_metrics["predictions"]], dim=1)
    # DCP serializes each tensor chunk with torch.save; anything else is a torch.save of ours.
    ranks = [
        {
            "checkpoints": count,
            "chunk_saves": saves.count("Tensor"),
            "other_saves": [name for name in saves if name != "Tensor"],
        }
        for count, saves in zip(fit.callback_metrics["checkpoints"], fit.callback_metrics["saves"])
    ]
    return {
        "best": checkpoint.best_model_path,
        "predictions": predictions.flatten(0, 1),
        "state": predict.callback_metrics["state"],
        "ranks": ranks,
    }


@pytest.mark.slow
def test_best_model_path_is_a_sharded_directory_that_load_from_checkpoint_loads_in_one_process(trained):
    best = Path(trained["best"])
    assert best.is_dir() and (best / "meta.json").is_file()
    with pytest.raises(IsADirectoryError):  # what Lightning's own call does with it
        HparamsMLP.load_from_checkpoint(best)
    model = lightning_zero3.load_from_checkpoint(HparamsMLP, best)
    assert not torch.distributed.is_initialized()  # one process, no process group
    assert type(model) is HparamsMLP and model.hparams.lr == 0.02 and model.hparams.note == "trained"
    model.eval()
    with torch.no_grad():
        predictions = torch.cat([model(x) for x in DataLoader(dataset().tensors[0], batch_size=8)])
    torch.testing.assert_close(predictions, trained["predictions"], rtol=0, atol=1e-6)


def test_load_from_checkpoint_passes_keyword_overrides_and_strict_loading_as_lightning_does(trained):
    model = lightning_zero3.load_from_checkpoint(HparamsMLP, trained["best"], note="override")
    assert model.hparams.note == "override" and model.hparams.lr == 0.02

    class Wider(HparamsMLP):
        def __init__(self, lr: float = 0.01, note: str = "default") -> None:
            super().__init__(lr=lr, note=note)
            self.extra = torch.nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match="extra.weight"):
        lightning_zero3.load_from_checkpoint(Wider, trained["best"])
    with pytest.warns(Warning, match="extra.weight"):  # Lightning's warning for a non-strict load
        assert isinstance(lightning_zero3.load_from_checkpoint(Wider, trained["best"], strict=False), Wider)


def test_load_checkpoint_returns_the_lightning_dict_with_whole_tensors(trained):
    checkpoint = lightning_zero3.load_checkpoint(trained["best"])
    assert checkpoint["hyper_parameters"] == {"lr": 0.02, "note": "trained"}
    assert checkpoint["epoch"] in (0, 1) and checkpoint["global_step"] in (4, 8)
    state = checkpoint["state_dict"]
    assert state.keys() == trained["state"].keys()
    for key, value in trained["state"].items():
        assert torch.equal(state[key], value), key
    (optimizer,) = checkpoint["optimizer_states"]
    assert optimizer["state"][0]["exp_avg"].shape == state["net.inp.weight"].shape == (13, 7)  # numbered, whole
    assert "callbacks" in checkpoint and "lr_schedulers" in checkpoint
    weights = lightning_zero3.load_checkpoint(trained["best"], weights_only=True)
    assert (
        "optimizer_states" not in weights
        and "callbacks" not in weights
        and weights["state_dict"].keys() == state.keys()
    )


def test_load_checkpoint_reads_a_full_file_too(tmp_path):
    path = tmp_path / "full.ckpt"
    weights = {"net.w": torch.arange(6.0).reshape(2, 3)}
    torch.save({"state_dict": weights, "epoch": 3, "optimizer_states": []}, path)
    checkpoint = lightning_zero3.load_checkpoint(path)
    assert checkpoint["epoch"] == 3 and torch.equal(checkpoint["state_dict"]["net.w"], weights["net.w"])
    assert "optimizer_states" not in lightning_zero3.load_checkpoint(path, weights_only=True)


def test_a_directory_that_is_no_checkpoint_is_a_checkpoint_error_not_is_a_directory_error(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="it has no meta.json"):
        lightning_zero3.load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="it has no meta.json"):
        lightning_zero3.load_from_checkpoint(HparamsMLP, tmp_path)
    with pytest.raises(CheckpointError, match="in one process, with `lightning_zero3.load_checkpoint`"):
        read_full_file(tmp_path, trusted=False)  # the loader of full files names the loaders of directories


def test_load_from_checkpoint_of_a_checkpoint_no_trainer_saved_says_how_to_load_its_state_dict(tmp_path):
    save_mlp(tmp_path / "mlp.ckpt")  # saved by the engine: no Lightning version, no hyper-parameters
    with pytest.raises(CheckpointError, match=r"not saved by Lightning's Trainer.*load_checkpoint\(path\)"):
        lightning_zero3.load_from_checkpoint(HparamsMLP, tmp_path / "mlp.ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("name", [".metadata", "trainer_state.pt"])
def test_a_crafted_pickle_is_refused_unrun_unless_trusted(tmp_path, name):
    path = tmp_path / "mlp.ckpt"
    expected = save_mlp(path)
    marker = tmp_path / "payload_ran"
    craft(path, name, marker)
    with pytest.raises(CheckpointError, match="trusted=True") as raised:
        lightning_zero3.load_checkpoint(path)
    assert str(path / name) in str(raised.value) and not marker.exists()
    checkpoint = lightning_zero3.load_checkpoint(path, trusted=True)
    assert marker.exists()  # trusting runs what the pickle names: that is the opt-in
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in expected.items())


def test_tied_weights_share_one_tensor_as_in_module_state_dict(tmp_path):
    from lightning_zero3 import ShardedModel
    from lightning_zero3.checkpoint import save_sharded
    from tests.support.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT()
    sharded = ShardedModel(model)
    save_sharded(tmp_path / "gpt.ckpt", sharded, {"state_dict": model.state_dict()})
    state = lightning_zero3.load_checkpoint(tmp_path / "gpt.ckpt")["state_dict"]
    assert state["lm_head.weight"] is state["wte.weight"]
    assert state.keys() == sharded.full_state_dict(to_rank=None).keys()


def test_each_rank_saves_once_per_checkpoint_and_torch_save_runs_only_for_dcp_chunks_and_rank_0s_state(trained):
    """Adapted from Lightning's `test_model_checkpoint_no_extraneous_invocations` and
    `test_top_k_ddp` (which count torch.save calls): ModelCheckpoint saves once per epoch on every
    rank; our code calls torch.save once per checkpoint, on rank 0 (trainer_state.pt), as DDP
    does; every other call is DCP writing one tensor chunk into the rank's one shard file."""
    index = read_dcp_index(Path(trained["best"]) / ".metadata", trusted=False)
    for rank, result in enumerate(trained["ranks"]):
        assert result["checkpoints"] == 2  # max_epochs=2, one save per epoch, on every rank
        assert result["other_saves"] == (["dict"] * 2 if rank == 0 else [])
        chunks = sum(info.relative_path == f"__{rank}_0.distcp" for info in index.storage_data.values())
        assert chunks > 0 and result["chunk_saves"] == 2 * chunks
