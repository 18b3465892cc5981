"""The sharding engine: ZeRO stage 3 on a bare nn.Module and a process group; never imports Lightning.
The only door into it: code outside engine/ imports these names from here (tests/engine/test_engine_imports.py)."""

from lightning_zero3.engine.accounting import UnitSizes, live_peak, sent_row_bytes, step_bytes
from lightning_zero3.engine.checks import OrderMismatchError
from lightning_zero3.engine.comm import CollectiveError, Comm
from lightning_zero3.engine.config import ShardingConfig, config_field_names
from lightning_zero3.engine.dtypes import DTYPE_NAMES, parse_dtype
from lightning_zero3.engine.groups import destroy_group, new_group
from lightning_zero3.engine.left_sharded import forget, holder, remember_sharded
from lightning_zero3.engine.materialize import parameters_on_meta
from lightning_zero3.engine.model import ShardedModel
from lightning_zero3.engine.optim import AgreeingGradScaler, check_optimizer_fits_shards, clip_grad_norm_, grad_norms
from lightning_zero3.engine.plan import make_plan
from lightning_zero3.engine.quantize import RowCodec
from lightning_zero3.engine.reshard import resolve
from lightning_zero3.engine.shard import ShardedParam, note_shard_writes, shard_slice
from lightning_zero3.engine.state import full_optimizer_state, load_full_optimizer_state
from lightning_zero3.engine.whole_matrix import shard_state_built_whole, step_whole_matrices, whole_shapes

__all__ = [
    "DTYPE_NAMES",
    "AgreeingGradScaler",
    "CollectiveError",
    "Comm",
    "OrderMismatchError",
    "RowCodec",
    "ShardedModel",
    "ShardedParam",
    "ShardingConfig",
    "UnitSizes",
    "check_optimizer_fits_shards",
    "clip_grad_norm_",
    "config_field_names",
    "destroy_group",
    "forget",
    "full_optimizer_state",
    "whole_shapes",
    "grad_norms",
    "holder",
    "live_peak",
    "load_full_optimizer_state",
    "make_plan",
    "new_group",
    "note_shard_writes",
    "parameters_on_meta",
    "parse_dtype",
    "remember_sharded",
    "resolve",
    "sent_row_bytes",
    "shard_slice",
    "shard_state_built_whole",
    "step_bytes",
    "step_whole_matrices",
]
