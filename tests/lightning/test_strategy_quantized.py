"""Training with `quantize_weights=True, quantize_gradients=True` as users write it: a Trainer with
`ZeRO3Strategy(...)` on 2 gloo ranks (4 as 2 groups of 2), alone and with mixed precision,
`reshard_after_forward=False`, `offload="host"` and `accumulate_grad_batches=2`. One launched run
per setting fits the quantized model, saves a sharded and a full checkpoint, then resumes an
exact (unquantized) fit from each; the tests read its outputs. What is exact stays exact: the
checkpoints hold the fp32 master shards bit for bit (engine/quantize.py, Note: quantized
collectives: the master shards are never quantized), `state_dict()` inside `gathered_parameters`
gives them whole, and both checkpoints resume the same exact run; the loss stays within
LOSS_BOUND of the same fit without quantization."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.support.lit import LitMLP, become_lightning_rank, loader, max_difference, trainer
from tests.support.ranks import run_ranks

LOSS_BOUND = 0.01  # relative, each step's loss (the target for the final loss: 1%)
EPOCHS = 2  # 4 optimizer steps an epoch (48 samples, global batch 12); 2 with accumulation
QUANTIZED = {"quantize_weights": True, "quantize_gradients": True}
SETTINGS = {  # name -> (ranks, strategy options, Trainer options)
    "fp32": (2, {}, {}),
    "bf16-mixed": (2, {}, {"precision": "bf16-mixed"}),
    "16-mixed": (2, {}, {"precision": "16-mixed"}),
    "reshard_after_forward False": (2, {"reshard_after_forward": False}, {}),
    "offload host": (2, {"offload": "host"}, {}),
    "accumulate 2": (2, {}, {"accumulate_grad_batches": 2}),
    "shard_size 2 of 4": (4, {"shard_size": 2}, {}),
}


class _MasterShards(pl.Callback):
    """Each rank's fp32 master shards (the optimizer's parameters) by parameter name, at the start
    of training (after a checkpoint's load) and at its end."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.end: dict[str, torch.Tensor] = {}

    @staticmethod
    def read(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        engine = trainer.strategy.sharded_model()
        return {s.names[0]: s.param.detach().clone() for s in engine.sharded_params}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = self.read(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = self.read(trainer)


def _fit(world_size: int, options: dict, fit_options: dict, epochs: int, ckpt_path: str | None = None,
         state_dict_type: str = "sharded") -> tuple[pl.Trainer, LitMLP, _MasterShards]:  # fmt: skip
    from lightning_zero3 import ZeRO3Strategy

    if fit_options.get("precision") == "16-mixed":  # Lightning on CPU would fall back to bf16: fp16 by plugin
        from lightning.pytorch.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler("cpu")
        fit_options = {**fit_options, "precision": None, "plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    torch.manual_seed(0)
    model, shards = LitMLP(), _MasterShards()
    strategy = ZeRO3Strategy(state_dict_type=state_dict_type, **options)  # type: ignore[arg-type]
    fit = trainer(strategy, world_size, max_epochs=epochs, callbacks=[shards], **fit_options)
    fit.fit(model, loader(world_size), ckpt_path=ckpt_path)
    return fit, model, shards


def _train_save_resume(rank: int, world_size: int, options: dict, fit_options: dict, root: str) -> dict[str, Any]:
    become_lightning_rank(rank, world_size)
    out: dict[str, Any] = {}
    exact, exact_model, _ = _fit(world_size, options, fit_options, EPOCHS)
    out["exact_losses"] = exact_model.step_losses
    fit, model, shards = _fit(world_size, {**options, **QUANTIZED}, fit_options, EPOCHS)
    out["losses"], out["master"] = model.step_losses, shards.end
    sharded_path, full_path = f"{root}/sharded.ckpt", f"{root}/full.ckpt"
    fit.save_checkpoint(sharded_path)
    fit.strategy.lightning_options = _full(fit.strategy.lightning_options)
    fit.save_checkpoint(full_path)
    with fit.strategy.gathered_parameters(model):
        out["gathered"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["full"] = torch.load(full_path, weights_only=True)["state_dict"] if rank == 0 else None
    for name, path, kind in (("sharded", sharded_path, "sharded"), ("full", full_path, "full")):
        resumed, resumed_model, loaded = _fit(world_size, options, fit_options, EPOCHS + 1, path, kind)
        out[f"resumed_{name}"] = {"loaded": loaded.start, "losses": resumed_model.step_losses,
                                  "weights": resumed.strategy.full_state_dict(rank0_only=False)}  # fmt: skip
    return out


def _full(options: Any) -> Any:
    import dataclasses

    return dataclasses.replace(options, state_dict_type="full")


@pytest.fixture(scope="module", params=list(SETTINGS))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ranks, options, fit_options = SETTINGS[request.param]
    root = tmp_path_factory.mktemp(request.param.replace(" ", "_"))
    return run_ranks(_train_save_resume, ranks, options, fit_options, str(root), timeout_s=300)


@pytest.mark.slow
def test_the_loss_stays_within_the_bound_of_the_same_fit_without_quantization(run: list[dict[str, Any]]) -> None:
    for rank in run:
        assert len(rank["losses"]) == len(rank["exact_losses"]) > 0, rank["losses"]
        worst = max(abs(q / e - 1) for q, e in zip(rank["losses"], rank["exact_losses"]))
        assert worst <= LOSS_BOUND, (worst, rank["losses"], rank["exact_losses"])
        assert rank["losses"] != rank["exact_losses"]  # quantization was on: the fit is not the exact one


@pytest.mark.slow
def test_the_sharded_checkpoint_loads_the_master_shards_bit_for_bit(run: list[dict[str, Any]]) -> None:
    for rank in run:
        loaded, master = rank["resumed_sharded"]["loaded"], rank["master"]
        assert loaded.keys() == master.keys()
        assert all(torch.equal(loaded[k], master[k]) for k in master), max_difference(loaded, master)


@pytest.mark.slow
def test_the_full_checkpoint_holds_the_master_shards_bit_for_bit(run: list[dict[str, Any]]) -> None:
    full = run[0]["full"]  # loaded at the same ranks, each rank's shards again
    for rank in run:
        loaded, master = rank["resumed_full"]["loaded"], rank["master"]
        assert all(torch.equal(loaded[k], master[k]) for k in master), max_difference(loaded, master)
    assert all(v.dtype == torch.float32 for v in full.values())


@pytest.mark.slow
def test_state_dict_inside_gathered_parameters_is_the_full_checkpoints_weights(run: list[dict[str, Any]]) -> None:
    full = run[0]["full"]
    for rank in run:
        gathered = rank["gathered"]
        assert gathered.keys() == full.keys()
        assert all(torch.equal(gathered[k], full[k]) for k in full), max_difference(gathered, full)


@pytest.mark.slow
def test_an_exact_fit_resumes_the_same_from_the_sharded_and_the_full_checkpoint(run: list[dict[str, Any]]) -> None:
    for rank in run:
        sharded, full = rank["resumed_sharded"], rank["resumed_full"]
        assert len(sharded["losses"]) > 0 and sharded["losses"] == full["losses"]
        assert max_difference(sharded["weights"], full["weights"]) == 0.0
