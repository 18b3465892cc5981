"""`torch.compile` on a sharded model, 2 gloo ranks, backend "aot_eager" (dynamo's graphs and
AOT autograd's saved tensors, without the C++ compile time of inductor). The engine's hooks run
outside the traced region (calls.py, Note: torch.compile): compiled per block, with
`fullgraph=True`, every block shares one graph and no later step recompiles; compiled whole,
the model breaks only at unit boundaries; training stays exact against one process either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero3.engine import ShardedModel
from tests.support.adapted import HandsBack, launched
from tests.support.lit import LitMLP, loader, max_difference, reference_fit, trainer
from tests.support.models import MLP, mlp_batch
from tests.support.parity import max_param_difference, step_side_by_side
from tests.support.ranks import run_ranks

STEPS = 3


class GraphCounter:
    """A dynamo backend that counts the graphs it is given and runs them with "aot_eager"."""

    def __init__(self) -> None:
        self.graphs = 0
        self.inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return self.inner(gm, example_inputs)


def _compiled_training(rank: int, world_size: int, how: str) -> dict:
    torch._dynamo.reset()
    counter = GraphCounter()
    torch.manual_seed(0)
    reference = MLP(dim=64)
    torch.manual_seed(0)
    model = MLP(dim=64)
    sharded = ShardedModel(model)
    if how == "blocks":
        for block in model.blocks:
            block.compile(backend=counter, fullgraph=True)  # a graph break inside a block raises
    else:
        model.compile(backend=counter)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    step_side_by_side(reference, model, optimizers, mlp_batch(0), rank, world_size)
    first_step = counter.graphs
    with torch.compiler.set_stance("fail_on_recompile"):  # a later step that recompiles raises
        for step in range(1, STEPS):
            step_side_by_side(reference, model, optimizers, mlp_batch(step), rank, world_size)
    param_diff = max_param_difference(sharded, reference)
    # What autograd keeps from the compiled forward to backward: activations, not full weights.
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(mlp_batch(STEPS)[0][:6]).sum()
    kept = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in saved}.values())
    loss.backward()
    block_bytes = sum(unit.block_numel * 4 for unit in sharded._units[1:])
    return {"param_diff": param_diff, "graphs": first_step, "kept": kept, "block_bytes": block_bytes}


@pytest.mark.slow
def test_blocks_compiled_one_by_one_share_one_full_graph_and_train_exactly():
    for result in run_ranks(_compiled_training, 2, "blocks"):
        assert result["param_diff"] < 1e-5
        assert result["graphs"] == 1, f"{result['graphs']} graphs for 3 identical blocks: the hooks are traced"
        assert result["kept"] < result["block_bytes"] // 2, f"the compiled blocks keep full weights: {result}"


@pytest.mark.slow
def test_a_model_compiled_whole_breaks_only_at_unit_boundaries_and_trains_exactly():
    """4 units (root + 3 blocks), hooks on the root's owner modules too: the breaks cut the
    forward into a bounded number of graphs, compiled in the first step only."""
    for result in run_ranks(_compiled_training, 2, "whole"):
        assert result["param_diff"] < 1e-5
        assert result["graphs"] <= 3, f"{result['graphs']} graphs: input layer, the blocks' shared graph, head"
        assert result["kept"] < result["block_bytes"] // 2, f"the compiled model keeps full weights: {result}"


class _CompiledBlocks(LitMLP):
    def configure_model(self) -> None:
        for block in self.net.blocks:
            block.compile(backend="aot_eager", fullgraph=True)


@pytest.mark.slow
def test_trainer_fit_with_blocks_compiled_in_configure_model_matches_one_process():
    """What the user guide recommends, through Lightning's launcher: exact against the eager
    reference on every rank."""
    torch.manual_seed(0)
    model = _CompiledBlocks()
    fit = trainer(launched("zero3"), 2, max_epochs=1, callbacks=[HandsBack(losses="lightning_module.step_losses")])
    fit.fit(model, loader(2))
    torch.manual_seed(0)
    reference = LitMLP()
    losses = reference_fit(reference, epochs=1)
    assert max_difference(model.state_dict(), reference.state_dict()) < 1e-5
    for rank_losses in fit.callback_metrics["losses"]:
        assert len(rank_losses) == len(losses)
        assert max(abs(a - b) for a, b in zip(rank_losses, losses)) < 1e-5
