"""Lightning callbacks that keep or edit whole-shaped weights outside forward, where the
parameters are this rank's 1-D shards: refused before they run (as Lightning refuses
`StochasticWeightAveraging` under FSDP and DeepSpeed), with what to do instead."""

from __future__ import annotations

from collections.abc import Iterable

from lightning.pytorch.callbacks import Callback, ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException

_AVERAGING = (
    "it averages a whole copy of the LightningModule (made before sharding) with the live parameters, which are "
    "this rank's 1-D shards. The average is elementwise, so it can be kept on the shards: use "
    "lightning_zero3.ShardedWeightAveraging or ShardedEMAWeightAveraging (the same arguments; "
    "lightning_zero3/tools/averaging.py)."
)
_PRUNING = (
    "torch.nn.utils.prune replaces each pruned parameter by `weight_orig * weight_mask`, and the parameters are the "
    "engine's shards. Prune the whole model before fit and make it permanent (`prune.remove`), or zero weights in "
    "place inside `trainer.strategy.gathered_parameters(module, modifier_rank=0)`; see docs/user-guide.md."
)
REFUSED: dict[type[Callback], str] = {
    StochasticWeightAveraging: _AVERAGING,
    WeightAveraging: _AVERAGING,
    ModelPruning: _PRUNING,
}


def refuse_unsupported_callbacks(callbacks: Iterable[Callback], strategy_name: str) -> None:
    """Raise `MisconfigurationException` naming the first callback that cannot run on shards."""
    for callback in callbacks:
        for kind, why in REFUSED.items():
            if isinstance(callback, kind):
                raise MisconfigurationException(
                    f"{type(callback).__name__} is not supported by {strategy_name}: {why} Remove it from the "
                    f"Trainer's callbacks (or from `configure_callbacks`)."
                )
