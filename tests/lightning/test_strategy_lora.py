"""A LoRA fine-tune under the Trainer, as a user moving from DDP runs it: peft's adapters on a
Hugging Face GPT-2 (every base weight frozen), gradient accumulation and clipping by norm; fit,
`save_checkpoint` into a new nested directory, resume with `ckpt_path`, then read the weights in
one process. Every number equals one process training on the global batches. 2 ranks started by
the strategy's launcher (tests/support/adapted.py `launched`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.engine.test_engine_frozen import tiny_lora_gpt2
from tests.support.adapted import HandsBack, SavesAfterFit, launched
from tests.support.lit import max_difference, trainer

TOL = 1e-5
SAMPLES, PER_RANK_BATCH, ACCUMULATE, CLIP = 16, 2, 2, 0.02  # 2 optimizer steps per epoch at 2 ranks


def tokens() -> torch.Tensor:
    return torch.randint(0, 37, (SAMPLES, 8), generator=torch.Generator().manual_seed(3))


class LitLora(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = tiny_lora_gpt2()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach())))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.02)


def _fit(epochs: int, model: LitLora, saved: Path, ckpt_path: Path | None = None) -> list[list[float]]:
    """Each rank's losses of a launched `fit` that saves into `saved` after it."""
    fit = trainer(
        launched("zero3"), 2, max_epochs=epochs, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP,
        callbacks=[SavesAfterFit(saved), HandsBack(losses="lightning_module.losses")],
    )  # fmt: skip
    fit.fit(model, DataLoader(TensorDataset(tokens()), batch_size=PER_RANK_BATCH), ckpt_path=ckpt_path)
    return fit.callback_metrics["losses"]


def _reference() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process, the global batch of both ranks: Lightning's DistributedSampler shuffles
    (seed 0, reshuffled each epoch) and gives rank r every other sample of that order, so
    micro-batch k of both ranks together is samples 4k..4k+3 of it."""
    model = LitLora()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = model.configure_optimizers()
    data, global_batch = tokens(), 2 * PER_RANK_BATCH
    losses, norms = [], []
    for epoch in range(2):
        sampler = DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        for k in range(SAMPLES // global_batch):
            x = data[order[k * global_batch : (k + 1) * global_batch]]
            loss = model.model(input_ids=x, labels=x).loss
            (loss / ACCUMULATE).backward()
            losses.append(float(loss.detach()))
            if (k + 1) % ACCUMULATE == 0:
                norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIP)))
                opt.step()
                opt.zero_grad()
    return losses, {k: v.detach() for k, v in model.state_dict().items()}, norms


@pytest.mark.slow
def test_lora_fit_save_resume_and_load_equal_one_process(tmp_path: Path) -> None:
    pytest.importorskip("peft", reason="peft (the test extra) is needed for a LoRA model")
    import lightning_zero3

    losses, state, norms = _reference()
    assert min(norms) > CLIP, f"clipping never engaged (norms {norms}): the test would not cover it"
    initial = LitLora().state_dict()
    lora = [k for k in state if "lora_" in k]
    assert max_difference({k: state[k] for k in lora}, {k: initial[k] for k in lora}) > 1e-3, "adapters did not train"

    saved = tmp_path / "runs" / "lora" / "epoch0"  # none of these directories exists yet
    first_losses = _fit(1, LitLora(), saved)
    resumed = LitLora()
    final = tmp_path / "runs" / "lora" / "final"
    resumed_losses = _fit(2, resumed, final, ckpt_path=saved)
    for rank in range(2):
        rank_losses = first_losses[rank] + resumed_losses[rank]
        assert len(rank_losses) == len(losses)
        assert max(abs(a - b) for a, b in zip(rank_losses, losses)) < TOL, (rank_losses, losses)
    assert max_difference(resumed.state_dict(), state) < TOL  # the whole weights the launcher handed back
    loaded = lightning_zero3.load_from_checkpoint(LitLora, final)  # one process, no group
    assert max_difference(loaded.state_dict(), state) < TOL
