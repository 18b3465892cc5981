"""N ranks == one process on the global batch (fp32, 1e-5): after every step each rank's shard
gradients equal the matching slice of the reference gradient, and the whole parameters equal the
reference's. Each test changes one thing about the training recipe."""

from __future__ import annotations

from functools import partial

import pytest

from tests.support.models import (
    MLP,
    ReusedBlockModel,
    TinyGPT,
    gpt_batch,
    mlp_batch,
    mlp_biases_only,
    mlp_frozen_block,
    mlp_frozen_input,
)
from tests.support.parity import Recipe, adamw, adamw_large_eps, lm_loss, no_decay_for_biases_and_norms, run_parity, sgd
from tests.support.ranks import run_ranks

TOL = 1e-5


def parity(recipe: Recipe, world_size: int) -> dict[str, float]:
    """Run `recipe` on `world_size` ranks, assert every rank matches the reference, and return
    rank 0's result (`min_norm` and `clipped` describe the reference, the same on every rank)."""
    results = run_ranks(run_parity, world_size, recipe)
    worst = {key: max(r[key] for r in results) for key in ("param", "grad", "loss", "norm")}
    assert worst["param"] < TOL, f"parameters differ from the reference by {worst['param']:.3g}"
    assert worst["grad"] < TOL, f"shard gradients differ from the reference slices by {worst['grad']:.3g}"
    assert worst["loss"] < TOL, f"loss differs from the reference by {worst['loss']:.3g}"
    assert worst["norm"] < TOL, f"global grad norm differs from the reference by {worst['norm']:.3g}"
    assert results[0]["moved"] > 100 * TOL, "the reference did not train: parity would hold trivially"
    return results[0]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer", [sgd, adamw], ids=["sgd", "adamw"])
def test_mlp_matches_single_process(optimizer, world_size):
    parity(Recipe(model=MLP, batch=mlp_batch, optimizer=optimizer, steps=4), world_size)


def test_param_groups_chosen_by_name_match_single_process():
    """Shards are 1-D, so groups must be picked by name; weight decay 0.5 makes a wrong split show."""
    recipe = Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, param_groups=no_decay_for_biases_and_norms)
    parity(recipe, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer", [sgd, adamw_large_eps], ids=["sgd", "adamw"])
def test_tied_weights_match_single_process(optimizer, world_size):
    """TinyGPT's lm_head.weight is wte.weight: one shard, gradients from both uses summed, one
    optimizer state."""
    parity(Recipe(model=TinyGPT, batch=gpt_batch, loss=lm_loss, optimizer=optimizer), world_size)


def test_module_called_twice_in_forward_matches_single_process():
    parity(Recipe(model=ReusedBlockModel, batch=mlp_batch, optimizer=adamw), 2)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_matches_single_process(mode):
    parity(Recipe(model=partial(MLP, checkpointing=mode), batch=mlp_batch, optimizer=adamw), 2)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_accumulation_matches_single_process(world_size):
    parity(Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, accumulate=3), world_size)


@pytest.mark.slow
def test_clipping_by_global_norm_matches_single_process():
    result = parity(Recipe(model=MLP, batch=mlp_batch, optimizer=sgd, clip_norm=0.05), 3)
    assert result["min_norm"] > 0.05, "the gradient norm never exceeded clip_norm: nothing was clipped"


def test_clipping_by_value_matches_single_process():
    result = parity(Recipe(model=MLP, batch=mlp_batch, optimizer=sgd, clip_value=0.01), 2)
    assert result["clipped"] > 0.05, "almost no gradient element exceeded clip_value: nothing was clipped"


@pytest.mark.parametrize("model", [mlp_frozen_block, mlp_frozen_input], ids=["block", "input_layer"])
def test_frozen_parameters_match_single_process(model):
    """Frozen parameters get no gradient (None, as in the reference) and do not move."""
    parity(Recipe(model=model, batch=mlp_batch, optimizer=adamw), 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("threshold", "world_size"), [(64, 2), (64, 3), (100_000, 2)], ids=["64-2", "64-3", "everything_whole-2"]
)
def test_persistent_small_parameters_match_single_process(threshold, world_size):
    """Parameters of <= threshold elements (64: biases, norms) stay whole; their gradients are
    all-reduced at the end of backward, even when no sharded unit is left to start it."""
    options = {"persistence_threshold": threshold}
    recipe = Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, sharded_kwargs=options)
    parity(recipe, world_size)


def test_training_only_persistent_parameters_matches_single_process():
    """Biases and norms trained, big weights frozen (BitFit): no unit has a gradient to reduce,
    yet the persistent gradients must still be averaged over ranks."""
    options = {"persistence_threshold": 64}
    recipe = Recipe(model=mlp_biases_only, batch=mlp_batch, optimizer=adamw, sharded_kwargs=options)
    parity(recipe, 2)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_depth_does_not_change_results(prefetch):
    options = {"prefetch": prefetch}
    recipe = Recipe(model=partial(MLP, depth=4), batch=mlp_batch, optimizer=adamw, sharded_kwargs=options)
    parity(recipe, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_reductions_left_in_flight_during_backward_do_not_change_results(world_size):
    """Reduce-Scatters overlapping the next units' backward (up to 2 in flight), with tied
    weights, accumulation and a module called twice: gradients are added in when waited for."""
    options = {"reductions_in_flight": 2}
    parity(Recipe(model=TinyGPT, batch=gpt_batch, loss=lm_loss, optimizer=sgd, sharded_kwargs=options), world_size)
    parity(Recipe(model=MLP, batch=mlp_batch, optimizer=adamw, accumulate=3, sharded_kwargs=options), world_size)
    parity(Recipe(model=ReusedBlockModel, batch=mlp_batch, optimizer=adamw, sharded_kwargs=options), world_size)
