"""torch.optim.Muon on 1-D shards (engine/whole_matrix.py, Note: whole-matrix steps): built as
under DDP, it steps like one process running torch.optim.Muon on the global batch (fp32, 1e-5),
every step, at 2 and 3 ranks (uneven padding), with whole (persistent) and frozen matrices in
its groups; its momentum is the shard's; its full state equals the one process's and loads at
another world size; the extra bytes per step are the formula's."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero3.engine import ShardedModel, full_optimizer_state, load_full_optimizer_state, whole_shapes
from lightning_zero3.engine import step_whole_matrices as step_whole
from lightning_zero3.engine.shard import shard_slice
from lightning_zero3.engine.whole_matrix import balanced_owners
from tests.support import models
from tests.support.adapted import SavesAfterFit, launched
from tests.support.cuda_standin import standin
from tests.support.fabric_helpers import fabric
from tests.support.lit import LitMLP, loader, max_difference, reference_fit, trainer
from tests.support.parity import local_slice
from tests.support.ranks import run_ranks

STEPS = 4
GLOBAL_STEPS = 3  # then Newton-Schulz's bf16 rounding of one element flips, as under DDP
SAVE_AFTER = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = models.MLP()
    model.blocks[2].fc1.weight.requires_grad_(False)  # a frozen matrix in Muon's group
    return model


def _optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon on the 2-D weights chosen as torch's docs do (`p.ndim == 2`), in two groups (one
    with another lr rule and without Nesterov), AdamW on the rest."""
    fc1 = [p for n, p in model.named_parameters() if p.ndim == 2 and "fc1" in n]
    other_2d = [p for n, p in model.named_parameters() if p.ndim == 2 and "fc1" not in n]
    rest = [p for p in model.parameters() if p.ndim != 2]
    muon = torch.optim.Muon([
        {"params": fc1}, {"params": other_2d, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
    ], lr=0.02, weight_decay=0.1)  # fmt: skip
    return [muon, torch.optim.AdamW(rest, lr=0.01)]


def _step(model: nn.Module, optimizers: list[torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor) -> bool:
    """One step; whether every gradient was still there after the optimizers stepped."""
    F.mse_loss(model(x), y).backward()
    with_grads = [p for p in model.parameters() if p.grad is not None]
    for optimizer in optimizers:
        optimizer.step()
    kept = all(p.grad is not None for p in with_grads)
    for optimizer in optimizers:
        optimizer.zero_grad()
    return kept


def _ddp_step(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], x: torch.Tensor, y: torch.Tensor, n: int
) -> None:
    """One process stepping on the gradient DDP averages: each rank's slice's, summed in rank
    order, divided by N (engine/reduce.py does the same)."""
    summed: list[torch.Tensor | None] = []
    for r in range(n):
        F.mse_loss(model(local_slice(x, r, n)), local_slice(y, r, n)).backward()
        grads = [p.grad for p in model.parameters()]
        summed = grads if not summed else [a if a is None else a + b for a, b in zip(summed, grads)]  # type: ignore[operator]
        model.zero_grad()
    for p, g in zip(model.parameters(), summed):
        p.grad = None if g is None else g / n
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _build(world_size: int, start: dict[str, torch.Tensor] | None = None):
    model = _model()
    if start is not None:
        model.load_state_dict(start)
    # inp (13x7) and head (5x13) stay whole: the optimizer's own step updates them.
    sharded = ShardedModel(model, persistence_threshold=100)
    with whole_shapes(sharded.sharded_params):
        optimizers = _optimizers(model)
    step_whole(sharded, optimizers[0], "test")
    return model, sharded, optimizers


def _max_difference(sharded: ShardedModel, reference: nn.Module) -> float:
    full = sharded.full_state_dict(to_rank=None)
    return max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())


def _train(rank: int, world_size: int, save_after: int) -> dict[str, Any]:
    reference, ddp = _model(), _model()
    ref_optimizers, ddp_optimizers = _optimizers(reference), _optimizers(ddp)
    model, sharded, optimizers = _build(world_size)
    worst = {"global": 0.0, "ddp": 0.0}
    saved, ref_saved = None, None
    for step in range(STEPS):
        x, y = models.mlp_batch(step)
        _step(reference, ref_optimizers, x, y)
        _ddp_step(ddp, ddp_optimizers, x, y, world_size)
        kept = _step(model, optimizers, local_slice(x, rank, world_size), local_slice(y, rank, world_size))
        sharded.stats.end_step()
        if step < GLOBAL_STEPS:
            worst["global"] = max(worst["global"], _max_difference(sharded, reference))
        worst["ddp"] = max(worst["ddp"], _max_difference(sharded, ddp))
        if step + 1 == save_after:  # a full checkpoint: whole weights and whole optimizer state
            saved = copy.deepcopy({  # whole parameters' state is the live tensors
                "model": sharded.full_state_dict(to_rank=None),
                "optimizers": [full_optimizer_state(sharded, o, to_rank=None) for o in optimizers],
            })
            ref_saved = copy.deepcopy(ddp_optimizers[0].state_dict())
    report = sharded.stats.report(optimizers)
    ref_state = ddp_optimizers[0].state_dict()["state"]
    muon = optimizers[0]
    momentum = {}
    for index, p in enumerate(q for group in muon.param_groups for q in group["params"]):
        sp = sharded.sharded_param(p)
        if sp is not None and p in muon.state:
            buf = muon.state[p]["momentum_buffer"]
            expected = shard_slice(ref_state[index]["momentum_buffer"], sp.rank, sp.world_size)
            momentum[sp.name] = (buf.numel(), sp.shard_numel, float((buf - expected).abs().max()))
    return {
        **worst, "momentum": momentum, "grads_kept": kept, "saved": saved, "ref_saved": ref_saved,
        "measured": report["last_step"].get("all_to_all"), "expected": report["expected_step_bytes"].get("all_to_all"),
    }


@pytest.fixture(scope="module", params=[2, 3])
def trained(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_ranks(_train, request.param, SAVE_AFTER)


def test_muon_on_shards_steps_like_one_process_on_the_global_batch(trained):
    assert all(r["global"] < 1e-5 for r in trained[1]), [r["global"] for r in trained[1]]


def test_muon_on_shards_steps_like_one_process_on_ddps_averaged_gradient(trained):
    """Every step; the global batch's gradient differs in its last bits, and from the 4th step
    one element's bf16 rounding in Newton-Schulz flips (2.4e-4 off, under DDP alike)."""
    assert all(r["ddp"] < 1e-6 for r in trained[1]), [r["ddp"] for r in trained[1]]


def test_muon_leaves_the_gradients_for_zero_grad_as_torch_does(trained):
    assert all(r["grads_kept"] for r in trained[1])


def test_muon_momentum_is_the_shards_piece_of_the_one_process_momentum(trained):
    for result in trained[1]:
        assert sorted(result["momentum"]) == [
            "blocks.0.fc1.weight", "blocks.0.fc2.weight", "blocks.1.fc1.weight", "blocks.1.fc2.weight",
            "blocks.2.fc2.weight",
        ]  # the frozen blocks.2.fc1.weight has none  # fmt: skip
        for name, (numel, shard_numel, difference) in result["momentum"].items():
            assert numel == shard_numel, name
            assert difference < 1e-6, name


def test_muon_extra_bytes_per_step_are_the_formulas(trained):
    for result in trained[1]:
        assert result["measured"]["calls"] == 2
        assert result["measured"]["payload_bytes"] == result["expected"] > 0


def test_muon_full_state_equals_the_one_process_state(trained):
    result = trained[1][0]
    saved, reference = result["saved"]["optimizers"][0], result["ref_saved"]
    assert saved["param_groups"] == reference["param_groups"]
    assert saved["state"].keys() == reference["state"].keys()
    for index, entry in saved["state"].items():
        assert torch.allclose(entry["momentum_buffer"], reference["state"][index]["momentum_buffer"], atol=1e-6)


def _resume(rank: int, world_size: int, saved: dict[str, Any], saved_at: int) -> float:
    """From a full checkpoint saved at `saved_at` ranks, the last steps; the worst difference
    from one process on DDP's gradients trained without a break."""
    saved = copy.deepcopy(saved)  # the arguments' tensors are in memory every rank shares
    ddp = _model()
    ddp_optimizers = _optimizers(ddp)
    model, sharded, optimizers = _build(world_size, saved["model"])
    for optimizer, state in zip(optimizers, saved["optimizers"]):
        load_full_optimizer_state(sharded, optimizer, state)
    worst = 0.0
    for step in range(STEPS):
        x, y = models.mlp_batch(step)
        _ddp_step(ddp, ddp_optimizers, x, y, saved_at if step < SAVE_AFTER else world_size)
        if step >= SAVE_AFTER:
            _step(model, optimizers, local_slice(x, rank, world_size), local_slice(y, rank, world_size))
            sharded.stats.end_step()
            worst = max(worst, _max_difference(sharded, ddp))
    return worst


def test_a_full_muon_checkpoint_resumes_at_another_world_size(trained):
    world_size, results = trained
    resumed = run_ranks(_resume, 5 - world_size, results[0]["saved"], world_size)  # 2 -> 3, 3 -> 2
    assert max(resumed) < 1e-6, resumed


def test_balanced_owners_give_the_largest_matrices_to_the_least_loaded_ranks():
    assert balanced_owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40 | 30, 20 | 10
    assert balanced_owners([5, 5, 5], 3) == [0, 1, 2]


# ---- as users write it: Trainer (manual and automatic optimization) and Fabric --------------
class LitMuon(LitMLP):
    """The 2025-26 recipe as a DDP user writes it: Muon on the 2-D weights (torch's docs' filter),
    AdamW on the rest with manual optimization; Muon alone with automatic optimization."""

    def __init__(self, *, manual: bool, reference: bool = False) -> None:
        super().__init__(manual=manual)
        self.reference = reference

    def configure_optimizers(self) -> Any:
        muon = torch.optim.Muon([p for p in self.parameters() if p.ndim == 2], lr=0.02)
        if self.automatic_optimization:
            return muon
        adamw = torch.optim.AdamW([p for p in self.parameters() if p.ndim != 2], lr=self.lr)
        return _BothSteps([muon, adamw]) if self.reference else [muon, adamw]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        x, y = batch
        optimizers = self.optimizers()
        self.manual_backward(F.mse_loss(self(x), y))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        return None


class _BothSteps:
    """The one `opt` of tests/support/lit.py's `reference_fit`, for the manual recipe's two optimizers."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()


def _fit_muon(strategy: str, *, manual: bool, steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = LitMuon(manual=manual)
    # batches, not max_steps: with two optimizers each batch is two of Lightning's steps
    trainer(launched(strategy), 2, max_epochs=1, limit_train_batches=steps).fit(model, loader(2))
    return model.state_dict()  # handed back by the launcher: whole weights


@pytest.mark.parametrize("manual", [True, False], ids=["manual", "automatic"])
def test_the_trainer_trains_torch_muon_like_one_process(manual):
    """Two steps: in the third of this model's, one process's bf16 rounding flips (as DDP's)."""
    torch.manual_seed(0)
    one_process = LitMuon(manual=manual, reference=True)
    reference_fit(one_process, max_steps=2)
    assert max_difference(_fit_muon("zero3", manual=manual, steps=2), one_process.state_dict()) < 1e-5


def test_the_trainer_trains_torch_muon_like_ddp():
    """A whole epoch, past the step where one process's bf16 rounding flips: as DDP does."""
    trained = {strategy: _fit_muon(strategy, manual=True, steps=4) for strategy in ("zero3", "ddp")}
    assert max_difference(trained["zero3"], trained["ddp"]) < 1e-6


def _fabric_muon(rank: int, world_size: int) -> float:
    """Muon and AdamW built on the whole model, then `fabric.setup(model, muon, adamw)`; the worst
    difference, every step, from one process stepping on DDP's averaged gradient (`_ddp_step`).
    Not the global batch's: its gradient differs in the last bits, and Newton-Schulz's bf16
    rounding turns that into ~1e-3 within 2 to 3 steps for some initial weights (as under DDP)."""
    f = fabric(rank, world_size)
    torch.manual_seed(0)
    reference, model = models.MLP(), models.MLP()
    model.load_state_dict(reference.state_dict())
    build = lambda m: [
        torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
        torch.optim.AdamW([p for p in m.parameters() if p.ndim != 2], lr=0.01),
    ]  # fmt: skip
    ref_optimizers = build(reference)
    model, *optimizers = f.setup(model, *build(model))
    worst = 0.0
    for step in range(STEPS):
        x, y = models.mlp_batch(step)
        _ddp_step(reference, ref_optimizers, x, y, world_size)
        f.backward(F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        whole = f.strategy.sharded_model(model).full_state_dict(to_rank=None)
        worst = max(worst, max(float((whole[k] - v).abs().max()) for k, v in reference.state_dict().items()))
    return worst


def test_fabric_trains_torch_muon_passed_to_setup_like_one_process():
    assert max(run_ranks(_fabric_muon, 2)) < 1e-6


# ---- GPU habits, on CPU (tests/support/cuda_standin.py) and hybrid sharding ---------------------------
def _muon_under_standin(rank: int, world_size: int) -> dict[str, Any]:
    with standin() as mode:
        model, sharded, optimizers = _build(world_size)
        for step in range(2):
            x, y = models.mlp_batch(step)
            F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
            before = Counter(mode.counts)
            optimizers[0].step()
            counts = Counter(mode.counts) - before
            for optimizer in optimizers:
                optimizer.zero_grad()
    return {"races": mode.races, "step_counts": dict(counts)}


def test_muons_step_reads_nothing_on_the_host_and_races_no_stream():
    for result in run_ranks(_muon_under_standin, 2):
        assert result["races"] == [], result["races"]
        assert result["step_counts"].get("host_reads", 0) == 0, result["step_counts"]


def _hybrid(rank: int, world_size: int) -> float:
    reference = _model()
    ref_optimizers = _optimizers(reference)
    model = _model()
    sharded = ShardedModel(model, shard_size=2)  # 2 groups of 2 ranks, each stepping its replica
    with whole_shapes(sharded.sharded_params):
        optimizers = _optimizers(model)
    step_whole(sharded, optimizers[0], "test")
    worst = 0.0
    for step in range(2):
        x, y = models.mlp_batch(step)
        _step(reference, ref_optimizers, x, y)
        _step(model, optimizers, local_slice(x, rank, world_size), local_slice(y, rank, world_size))
        worst = max(worst, _max_difference(sharded, reference))
    return worst


def test_muon_with_shard_size_steps_like_one_process():
    assert max(run_ranks(_hybrid, 4)) < 1e-5


def _fit_and_resume(strategy: str, directory: Path) -> dict[str, torch.Tensor]:
    """An epoch at 2 ranks saved (zero3: sharded), the next resumed from it at 3 ranks."""
    torch.manual_seed(0)
    model = LitMuon(manual=True)
    trainer(launched(strategy), 2, max_epochs=1, callbacks=[SavesAfterFit(directory / "epoch1.ckpt")]).fit(
        model, loader(2)
    )
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    resumed = LitMuon(manual=True)
    trainer(launched(strategy), 3, max_epochs=2).fit(resumed, loader(3), ckpt_path=directory / "epoch1.ckpt")
    return resumed.state_dict()


@pytest.mark.slow
def test_a_sharded_muon_checkpoint_resumes_at_another_world_size_as_ddps_does(tmp_path):
    (tmp_path / "zero3").mkdir()
    (tmp_path / "ddp").mkdir()
    zero3 = _fit_and_resume("zero3", tmp_path / "zero3")
    assert (tmp_path / "zero3" / "epoch1.ckpt").is_dir()  # sharded: a directory, each rank its pieces
    assert max_difference(zero3, _fit_and_resume("ddp", tmp_path / "ddp")) < 1e-6


def _write_inside_whole_shapes(rank: int, world_size: int) -> tuple[str, bool]:
    model = _model()
    sharded = ShardedModel(model, persistence_threshold=100)
    before = [s.param.data.clone() for s in sharded.sharded_params]
    try:
        with whole_shapes(sharded.sharded_params):
            torch.nn.init.constant_(model.blocks[0].fc1.weight, 1.0)  # a user's init in configure_optimizers
        message = ""
    except RuntimeError as err:
        message = str(err)
    unchanged = all(torch.equal(a, s.param.data) for a, s in zip(before, sharded.sharded_params))
    return message, unchanged


def test_a_write_to_a_parameter_while_optimizers_are_built_is_refused_and_leaves_the_shards():
    for message, unchanged in run_ranks(_write_inside_whole_shapes, 2):
        assert "blocks.0.fc1.weight" in message and "configure_model" in message, message
        assert unchanged
