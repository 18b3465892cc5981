"""lightning_zero3: ZeRO stage 3 for PyTorch Lightning (Trainer and Fabric).

import lightning_zero3  # registers strategy="zero3" with the Trainer and with Fabric
trainer = Trainer(strategy="zero3", devices=2)
fabric = Fabric(strategy="zero3", devices=2)
model = lightning_zero3.load_from_checkpoint(MyModule, best_model_path)  # one process, either kind
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero3.checkpoint import CheckpointError, consolidate_checkpoint, load_checkpoint, load_from_checkpoint
from lightning_zero3.engine import OrderMismatchError, ShardedModel
from lightning_zero3.fabric_strategy import ZeRO3FabricStrategy
from lightning_zero3.strategy import ZeRO3Strategy
from lightning_zero3.tools.averaging import ShardedEMAWeightAveraging, ShardedWeightAveraging
from lightning_zero3.tools.grads import grad_norm
from lightning_zero3.tools.summary import ShardingStatsMonitor

__all__ = [
    "CheckpointError",
    "OrderMismatchError",
    "ShardedEMAWeightAveraging",
    "ShardedModel",
    "ShardedWeightAveraging",
    "ShardingStatsMonitor",
    "ZeRO3FabricStrategy",
    "ZeRO3Strategy",
    "consolidate_checkpoint",
    "grad_norm",
    "load_checkpoint",
    "load_from_checkpoint",
]
__version__ = "0.1.0"

# Lightning has no entry-point discovery for strategies: register on import (once), in the
# Trainer's registry and in Fabric's (each builds its own class from the name "zero3").
ZeRO3Strategy.register_strategies(StrategyRegistry)
ZeRO3FabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
