"""The sharding engine: ZeRO stage 3 on a bare nn.Module and a process group; never imports Lightning."""

from lightning_zero3.engine.checks import OrderMismatchError
from lightning_zero3.engine.comm import CollectiveBytes, CollectiveError, CommStats
from lightning_zero3.engine.config import ShardingConfig
from lightning_zero3.engine.model import ShardedModel
from lightning_zero3.engine.optim import AgreeingGradScaler, check_optimizer_fits_shards, clip_grad_norm_, grad_norm
from lightning_zero3.engine.record import UnitStats
from lightning_zero3.engine.shard import ShardedParam, shard_numel

__all__ = [
    "AgreeingGradScaler", "CollectiveBytes", "CollectiveError", "CommStats", "OrderMismatchError", "ShardedModel",
    "ShardedParam", "ShardingConfig", "UnitStats", "check_optimizer_fits_shards", "clip_grad_norm_", "grad_norm",
    "shard_numel",
]  # fmt: skip
