"""The training loops compared, one per backend, run inside each rank process: the same GPT from
the same seed, the same AdamW, the same batches (rank r of step s gets windows[s, r]); a step is
timed from its start (the batch on the device) to the end of the optimizer step, synchronised."""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.measure import (
    DistCounter,
    StepRecorder,
    model_state_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    status_bytes,
)
from benchmarks.model import build_model, count_parameters, lm_loss, make_config

# name -> (label in tables, short label in charts, prefetch or None). Order: the order of a round.
BACKENDS: dict[str, tuple[str, str, int | None]] = {
    "ddp": ("PyTorch DDP", "PyTorch DDP", None),
    "fsdp2": ("PyTorch FSDP2 (fully_shard)", "PyTorch FSDP2", None),
    "lightning-ddp": ('Lightning strategy="ddp"', "Lightning ddp", None),
    "zero3-p0": ('Lightning strategy="zero3", prefetch=0', "Lightning zero3 p=0", 0),
    "zero3-p1": ('Lightning strategy="zero3", prefetch=1', "Lightning zero3 p=1", 1),
    "zero3-p2": ('Lightning strategy="zero3", prefetch=2', "Lightning zero3 p=2", 2),
    "engine-p1": ("ShardedModel without Lightning, prefetch=1", "ShardedModel p=1", 1),
    "engine-p1-async": ("ShardedModel without Lightning, prefetch=1, reductions_in_flight=1", "ShardedModel async", 1),
    # reshard_after_forward=False on both sides: units stay whole from forward to backward.
    "fsdp2-no-reshard": ("PyTorch FSDP2, reshard_after_forward=False", "FSDP2 no reshard", None),
    "zero3-p1-no-reshard": ('Lightning strategy="zero3", reshard_after_forward=False', "zero3 no reshard", 1),
    # reshard_after_forward=2 on both sides (4+ ranks): backward gathers inside pairs of ranks.
    "fsdp2-reshard-2": ("PyTorch FSDP2, reshard_after_forward=2", "FSDP2 reshard 2", None),
    "zero3-p1-reshard-2": ('Lightning strategy="zero3", reshard_after_forward=2', "zero3 reshard 2", 1),
    "engine-host": ('ShardedModel without Lightning, prefetch=1, offload="host"', "ShardedModel host", 1),
    "engine-disk": ("ShardedModel, prefetch=1, offload to host, optimizer state in $TMPDIR", "ShardedModel disk", 1),
    "deepspeed": ("DeepSpeed ZeRO-3, its defaults", "DeepSpeed ZeRO-3", None),
    "deepspeed-offload": ('DeepSpeed ZeRO-3, offload_optimizer device "cpu"', "DeepSpeed offload", None),
    "deepspeed-strict": ("DeepSpeed ZeRO-3, ~1 block live", "DeepSpeed ZeRO-3 strict", None),
}
# Not by default: DeepSpeed (optional) and the reshard pairs (settings of their own).
DEFAULT_BACKENDS = [name for name in BACKENDS if "deepspeed" not in name and "reshard" not in name]


def reshard_after_forward(backend: str) -> bool | int:
    """The `reshard_after_forward` a backend's name asks for (True unless it says otherwise)."""
    return False if backend.endswith("-no-reshard") else 2 if backend.endswith("-reshard-2") else True


@dataclass
class RunSpec:
    backend: str
    size: str
    vocab_size: int
    windows: torch.Tensor  # (steps, world_size, batch_size, block_size + 1)
    warmup: int  # leading steps trained but left out of the timings
    seed: int
    lr: float
    accelerator: str  # "cpu" or "gpu"
    accumulate: int = 1  # micro-batches per step, gradient sync off on all but the last (raw backends)


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def rank_main(rank: int, world_size: int, spec: RunSpec) -> dict[str, Any]:
    base_rss = reset_peak_rss()
    device = torch.device("cuda", rank) if spec.accelerator == "gpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls; MFU is against the TF32 peak
        torch.cuda.reset_peak_memory_stats(device)
    counter = DistCounter()
    counter.install()
    recorder = StepRecorder(world_size, device, counter)
    config = make_config(spec.size, spec.vocab_size)
    model = build_model(config, seed=spec.seed, device=device)
    psi = count_parameters(model)
    # (B, T) inputs and targets of this rank, per step
    batches = [(w[rank, :, :-1].contiguous().to(device), w[rank, :, 1:].contiguous().to(device)) for w in spec.windows]
    try:
        if spec.backend == "lightning-ddp" or spec.backend.startswith("zero3-"):
            extra = _run_lightning(rank, world_size, spec, model, batches, recorder)
        elif spec.backend.startswith("deepspeed"):
            from benchmarks.deepspeed_backend import run_deepspeed

            extra = run_deepspeed(rank, world_size, spec, model, batches, recorder)
        else:
            extra = _run_raw(spec, model, batches, recorder, device)
    finally:
        counter.uninstall()
    result = {"rank": rank, "psi": psi, "steps": recorder.steps, "base_rss_bytes": base_rss,
              "peak_rss_bytes": peak_rss_bytes(), **extra}  # fmt: skip
    if device.type == "cuda":
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
        result["device_name"] = torch.cuda.get_device_name(device)
    return result


def _run_raw(spec: RunSpec, model: nn.Module, batches: list, recorder: StepRecorder, device: torch.device
             ) -> dict[str, Any]:  # fmt: skip
    """Raw PyTorch (DDP, FSDP2) and the engine without Lightning."""
    sharded = None
    if spec.backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif spec.backend.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = reshard_after_forward(spec.backend)
        for block in model.h:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    elif spec.backend.startswith("engine-"):
        from lightning_zero3.engine import ShardedModel

        in_flight = 1 if spec.backend.endswith("-async") else None
        offload = {"offload": "host"} if spec.backend in ("engine-host", "engine-disk") else {}
        if spec.backend == "engine-disk":  # files under $TMPDIR, unlinked at once (engine/disk.py)
            offload["offload_dir"] = tempfile.gettempdir()
        sharded = ShardedModel(model, prefetch=BACKENDS[spec.backend][2], reductions_in_flight=in_flight, **offload)
    else:
        raise ValueError(f"unknown backend {spec.backend!r}")
    optimizer = make_optimizer(model.parameters(), spec.lr)
    wait = (lambda: sharded.stats.shard_group.last_step_gather_wait_s) if sharded is not None else None
    k = spec.accumulate
    for x, y in batches:
        recorder.start()
        optimizer.zero_grad(set_to_none=True)
        for micro, (mx, my) in enumerate(zip(x.chunk(k), y.chunk(k))):
            _set_sync(model, sharded, micro == k - 1)
            loss = lm_loss(model, mx, my) / k
            loss.backward()
        optimizer.step()
        if sharded is not None:
            sharded.stats.end_step()  # the traffic and the record of the step (its orders and micro-batches)
        recorder.stop(loss, wait)
    # RssAnon after the last step: what optimizer state on disk saves.
    extra: dict[str, Any] = {"model_state_bytes": model_state_bytes(model.parameters(), [optimizer]),
                             "anon_rss_bytes": status_bytes("RssAnon")}  # fmt: skip
    if sharded is not None:
        stats = sharded.stats
        extra.update(model_state_bytes=stats.model_state_bytes([optimizer]), peak_units_alive=stats.units.peak,
                     engine_step_bytes={k: vars(v).copy() for k, v in stats.shard_group.last_step.items()})  # fmt: skip
        extra["expected_step_bytes"] = sharded.stats.last_step_expected_bytes()  # k micro-batches, the last synced
    return extra


def _set_sync(model: nn.Module, sharded: Any, sync: bool) -> None:
    """Gradient sync on or off for the next backward: each backend's own switch."""
    if sharded is not None:
        sharded.set_requires_gradient_sync(sync)
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    else:  # DDP: `require_backward_grad_sync` is what its `no_sync()` context sets
        model.require_backward_grad_sync = sync


def _run_lightning(rank: int, world_size: int, spec: RunSpec, model: nn.Module, batches: list, recorder: StepRecorder
                   ) -> dict[str, Any]:  # fmt: skip
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_zero3 import ZeRO3Strategy

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return lm_loss(self, x, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters(), spec.lr)

    found: dict[str, Any] = {}

    class StepTimer(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            recorder.start()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            zero3 = trainer.strategy if isinstance(trainer.strategy, ZeRO3Strategy) else None
            recorder.stop(outputs["loss"], (lambda: zero3.stats["gather_wait_s"]) if zero3 is not None else None)
            if batch_idx < len(batches) - 1:
                return  # else after the last optimizer step, before teardown
            found["anon_rss_bytes"] = status_bytes("RssAnon")
            if zero3 is None:
                found["model_state_bytes"] = model_state_bytes(module.parameters(), trainer.optimizers)
                return
            for key, name in (("model_state_bytes",) * 2, ("peak_units_alive",) * 2, ("engine_step_bytes", "last_step"),
                              ("expected_step_bytes",) * 2):  # fmt: skip
                found[key] = zero3.stats[name]

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    # Lightning uses the process group already initialised by the launcher (as under torchrun).
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    reshard = reshard_after_forward(spec.backend)
    strategy: Any = (
        "ddp" if spec.backend == "lightning-ddp"
        else ZeRO3Strategy(prefetch=BACKENDS[spec.backend][2], reshard_after_forward=reshard)
    )  # fmt: skip
    # use_distributed_sampler=False: every rank gets its own slice of the global batch, as in the raw loops.
    trainer = pl.Trainer(strategy=strategy, accelerator=spec.accelerator, devices=world_size, max_steps=len(batches),
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
                         use_distributed_sampler=False, callbacks=[StepTimer()])  # fmt: skip
    cpu_batches = [(x.cpu(), y.cpu()) for x, y in batches]  # Lightning moves each batch to the device
    loader = torch.utils.data.DataLoader(cpu_batches, batch_size=None)
    trainer.fit(LitGPT(), loader)
    assert dist.is_initialized()
    return found
