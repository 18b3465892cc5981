"""After `fit` the module stays sharded, "at rest" (common/run.py, Note: run lifecycle), as under FSDP:
validate, test, predict and a second `fit` by the same strategy resume the same run and compute
what one process computes; the module's own `state_dict()` is refused on every rank, naming the
way to whole weights, `strategy.full_state_dict()`, which equals one process's; given to another
strategy and back, the first strategy's run no longer holds it and builds anew. 2 gloo ranks against one process.
On the harness's ranks (tests/support/ranks.py), which run several Trainer calls in one process as a
torchrun job does: Lightning's multiprocessing launcher starts new processes for each call, so no
module stays at rest between its calls (tests/lightning/test_strategy_lightning.py runs that sequence launched)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.support.lit import LitMLP, become_lightning_rank, dataset, loader, max_difference, reference_fit, trainer
from tests.support.ranks import run_ranks

TOL = 1e-5


def _fit_evaluate_fit_again(rank: int, world_size: int) -> dict[str, Any]:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    torch.manual_seed(0)
    model = LitMLP()
    strategy = ZeRO3Strategy()
    fit = trainer(strategy, world_size, max_epochs=1)
    fit.fit(model, loader(world_size))
    engine = strategy.sharded_model()
    shard_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    try:
        model.state_dict()
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    val = fit.validate(model, loader(world_size), verbose=False)[0]["val_loss"]
    test = fit.test(model, loader(world_size), verbose=False)[0]["test_loss"]
    predictions = torch.cat(fit.predict(model, loader(world_size)))  # type: ignore[arg-type]
    first = strategy.full_state_dict()  # rank 0 only
    first_losses = list(model.step_losses)
    fit.fit_loop.max_epochs = 2  # the same Trainer fits one more epoch, with a new optimizer
    fit.fit(model, loader(world_size))
    second = strategy.full_state_dict(rank0_only=False)
    reused = strategy.sharded_model() is engine
    # Another strategy takes the module (whole first, sharded anew); back with the first, its run
    # no longer holds the module and a new engine takes it from the other's shards.
    trainer(ZeRO3Strategy(), world_size).validate(model, loader(world_size), verbose=False)
    back = fit.validate(model, loader(world_size), verbose=False)[0]["val_loss"]
    rebuilt = strategy.sharded_model() is not engine
    return {
        "shard_shapes": shard_shapes, "refused": refused, "val": val, "test": test, "predictions": predictions,
        "first": first, "first_losses": first_losses, "second": second, "losses": model.step_losses,
        "reused": reused, "back": back, "rebuilt": rebuilt,
    }  # fmt: skip


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_fit_evaluate_fit_again, 2)


@pytest.mark.slow
def test_evaluation_and_a_second_fit_resume_the_run_at_rest_like_one_process(results: list[dict[str, Any]]) -> None:
    torch.manual_seed(0)
    reference = LitMLP()
    first_losses = reference_fit(reference, epochs=1)
    first = {k: v.clone() for k, v in reference.state_dict().items()}
    x, y = dataset().tensors
    with torch.no_grad():
        loss, outputs = float(F.mse_loss(reference(x), y)), reference(x)
    losses = first_losses + reference_fit(reference, epochs=2, first_epoch=1)  # a new optimizer, as fit makes
    with torch.no_grad():
        loss_after_second = float(F.mse_loss(reference(x), y))
    for rank, result in enumerate(results):
        assert result["reused"]
        assert all(len(shape) == 1 for shape in result["shard_shapes"].values()), result["shard_shapes"]
        assert abs(result["val"] - loss) < TOL and abs(result["test"] - loss) < TOL
        # predict's DistributedSampler (no shuffle) gives rank r the samples r, r + 2, ...
        assert float((result["predictions"] - outputs[rank::2]).abs().max()) < TOL
        assert max(abs(a - b) for a, b in zip(result["first_losses"], first_losses)) < TOL
        assert len(result["losses"]) == len(losses) == 8
        assert max(abs(a - b) for a, b in zip(result["losses"], losses)) < TOL
        assert max_difference(result["second"], reference.state_dict()) < TOL
        assert result["rebuilt"] and abs(result["back"] - loss_after_second) < TOL
    assert max_difference(results[0]["first"], first) < TOL and results[1]["first"] == {}


@pytest.mark.slow
def test_the_modules_own_state_dict_at_rest_is_refused_on_every_rank_naming_the_way_to_whole_weights(
    results: list[dict[str, Any]],
) -> None:
    for result in results:
        assert "full_state_dict()" in result["refused"] and "1-D shards" in result["refused"], result["refused"]
