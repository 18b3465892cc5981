"""DeepSpeed ZeRO-3 in the comparison: the raw engine in a plain loop (install, nothing compiled:
`DS_BUILD_OPS=0 pip install -e ".[bench]"`; without it these backends are skipped with one line).

On CPU: `DS_ACCELERATOR=cpu` before the first import (gloo without oneCCL); `build_shm_op` (a g++
build, minutes, for inference only) replaced by a no-op; the launcher's process group reused.
Every run is fp32, stage 3, the benchmark's own `torch.optim.AdamW`, no clipping, and
`stage3_param_persistence_threshold: 0` (every parameter partitioned, as zero3 and FSDP2 do):
DeepSpeed's defaults, a strict one keeping about one block of whole parameters alive, and
ZeRO-Offload of the optimizer to the CPU.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import torch
from torch import nn

DEEPSPEED_BACKENDS = ("deepspeed", "deepspeed-strict", "deepspeed-offload")
INSTALL = 'DS_BUILD_OPS=0 pip install deepspeed  (or DS_BUILD_OPS=0 pip install -e ".[bench]")'


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot run here, or None (the parent process never imports it)."""
    import importlib.util

    missing = importlib.util.find_spec("deepspeed") is None
    return f"deepspeed is not installed; install it with: {INSTALL}" if missing else None


def import_deepspeed() -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed calls torch's deprecated all_gather_into_tensor / reduce_scatter_tensor every step.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated.*")
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the module; `deepspeed.comm.torch` the attribute is torch)

    # [Note: DeepSpeed's shm op] `build_shm_op` is DeepSpeed-internal (0.19.8 tried). Without this no-op the first
    # `init_distributed` runs g++ for minutes; if the name disappears nothing is patched and it only gets slower.
    comm_module = sys.modules["deepspeed.comm.torch"]
    if hasattr(comm_module, "build_shm_op"):
        comm_module.build_shm_op = lambda: None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def ds_config(backend: str, model: nn.Module, batch_size: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if backend == "deepspeed-strict":  # the largest transformer block's elements
        one = max(sum(p.numel() for p in block.parameters()) for block in model.h)
        zero.update(stage3_max_live_parameters=one, stage3_max_reuse_distance=one, stage3_prefetch_bucket_size=one)
    offload = backend == "deepspeed-offload"
    if offload:  # ZeRO-Offload: master partitions and optimizer state in host memory, step on the CPU
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "zero_force_ds_cpu_optimizer": not offload,  # offload steps the benchmark's torch AdamW too
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages under `tensors` not counted yet (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    new = {ptr: n for ptr, n in storages.items() if ptr not in seen and n}
    seen.update(new)
    return sum(new.values())


def ds_model_state_bytes(engine: Any) -> dict[str, int]:
    """What a DeepSpeed ZeRO-3 rank holds of the model state, read from its partitions: the
    parameter partitions (`ds_tensor`, views of one flat buffer), the fp32 master partitions the
    optimizer steps on (the same storage as the parameter partitions when both are fp32 on the
    same device, then counted once), the flat gradient partition buffer, the inner optimizer's
    state. Communication buckets are not model state and are left out."""
    zero = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3
    seen: set[int] = set()
    params = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    param_bytes = _storage_bytes(params, seen)
    master_bytes = _storage_bytes(list(zero.fp32_partitioned_groups_flat), seen)
    grad_bytes = _storage_bytes([zero.grad_partitions_flat_buffer], seen)
    state = [v for s in zero.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    optim_bytes = _storage_bytes(state, seen)
    total = param_bytes + master_bytes + grad_bytes + optim_bytes
    return {"param": param_bytes, "master": master_bytes, "grad": grad_bytes, "optimizer": optim_bytes, "total": total}


def run_deepspeed(rank: int, world_size: int, spec: Any, model: nn.Module, batches: list, recorder: Any) -> dict:
    from benchmarks.backends import make_optimizer
    from benchmarks.measure import status_bytes
    from benchmarks.model import lm_loss

    # What torchrun would set; DeepSpeed asserts LOCAL_RANK (the process group exists already).
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size))
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the launcher's process group
    config = ds_config(spec.backend, model, batch_size=batches[0][0].shape[0])
    optimizer = make_optimizer(model.parameters(), spec.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for x, y in batches:
        recorder.start()
        loss = lm_loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        recorder.stop(loss)
    anon = status_bytes("RssAnon")  # after the last step, the engine alive
    return {"model_state_bytes": ds_model_state_bytes(engine), "ds_config": config, "anon_rss_bytes": anon}
