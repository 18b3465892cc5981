"""lightning_zero3: ZeRO stage 3 for PyTorch Lightning.

    import lightning_zero3  # registers strategy="zero3"
    trainer = Trainer(strategy="zero3", devices=2)
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero3.checkpoint import CheckpointError, consolidate_checkpoint
from lightning_zero3.engine import OrderMismatchError, ShardedModel
from lightning_zero3.strategy import ZeRO3Strategy

__all__ = ["CheckpointError", "OrderMismatchError", "ShardedModel", "ZeRO3Strategy", "consolidate_checkpoint"]
__version__ = "0.1.0"

# Lightning has no entry-point discovery for strategies: register on import (once).
ZeRO3Strategy.register_strategies(StrategyRegistry)
