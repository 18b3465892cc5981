"""A LightningModule holding a Hugging Face model, saved after `fit` the way its users save it:
`model.model.save_pretrained(path)` on rank 0, inside `trainer.strategy.gathered_parameters(...)`
over the HF model (on every rank), then `from_pretrained(path)` in one process equals a
one-process run. Outside the block `save_pretrained` refuses, where it used to write a model of
1-D shards without a word (common/run.py, Note: a module's own state_dict). 2 gloo ranks; a tiny GPT-2
built from a local config (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.support.lit import become_lightning_rank, trainer
from tests.support.ranks import run_ranks

transformers = pytest.importorskip("transformers")

STEPS = 3
SAMPLES = 8  # one optimizer step per epoch: every rank takes half of them


def tiny_gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=37, n_positions=8, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def sgd(params: Any) -> torch.optim.Optimizer:
    # Not AdamW: the keys' bias in `c_attn` has a zero gradient (softmax ignores a shift), whose
    # float noise AdamW's normalisation blows up to 3e-5 between any two runs.
    return torch.optim.SGD(params, lr=0.5)


def tokens() -> torch.Tensor:
    return torch.randint(0, 37, (SAMPLES, 8), generator=torch.Generator().manual_seed(1))


class LitGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt2()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return sgd(self.parameters())


def _fit_then_save_pretrained(rank: int, world_size: int, directory: str) -> str:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    model = LitGPT2()
    data = DataLoader(TensorDataset(tokens()), batch_size=SAMPLES // world_size)
    fit = trainer(ZeRO3Strategy(), world_size, max_epochs=STEPS)
    fit.fit(model, data)
    with fit.strategy.gathered_parameters(model.model):  # every rank
        if rank == 0:
            model.model.save_pretrained(Path(directory) / "inside")
    try:
        model.model.save_pretrained(Path(directory) / f"outside{rank}")
        return "saved"
    except RuntimeError as err:
        return str(err)


def one_process() -> Any:
    model = tiny_gpt2()
    optimizer = sgd(model.parameters())
    ids = tokens()
    for _ in range(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.slow
def test_save_pretrained_inside_gathered_parameters_on_rank_0_loads_equal_to_one_process(tmp_path: Path) -> None:
    outside = run_ranks(_fit_then_save_pretrained, 2, str(tmp_path), timeout_s=120)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "inside")
    expected = one_process().state_dict()
    state, initial = loaded.state_dict(), tiny_gpt2().state_dict()
    assert state.keys() == expected.keys()
    assert max(float((state[k] - expected[k]).abs().max()) for k in expected) < 1e-5
    assert max(float((state[k] - initial[k]).abs().max()) for k in expected) > 1e-2  # it trained
    for refused in outside:  # every rank
        assert "gathered_parameters" in refused and "1-D shard" in refused, refused
