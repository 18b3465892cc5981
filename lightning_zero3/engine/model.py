"""`ShardedModel`: ZeRO stage 3 on a bare `nn.Module`. Framework-independent.

sharded = ShardedModel(model, prefetch=1)      # model's parameters are now 1/N shards
optimizer = torch.optim.AdamW(model.parameters())
loss = model(x).mean(); loss.backward()         # gathers, reduce-scatters, prefetches
sharded.clip_grad_norm_(1.0); optimizer.step()
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero3.engine.accumulate import GradientSync, SyncState
from lightning_zero3.engine.buffers import BufferPool, indexed, stream_api
from lightning_zero3.engine.calls import PassState, engine_mode
from lightning_zero3.engine.checks import UNEVEN_FIX, RankChecks
from lightning_zero3.engine.comm import Comm
from lightning_zero3.engine.config import ShardingConfig
from lightning_zero3.engine.disk import DiskState
from lightning_zero3.engine.gathered import gathered_parameters
from lightning_zero3.engine.generation import install_synced_generate, remove_synced_generate
from lightning_zero3.engine.groups import consecutive_group, hybrid_groups
from lightning_zero3.engine.hooks import HookDriver
from lightning_zero3.engine.left_sharded import SHARD_AGAIN, forget, leave_sharded, restore_if_left_sharded
from lightning_zero3.engine.materialize import restore_whole, shard_parameters
from lightning_zero3.engine.offload import HostOffload, move_module
from lightning_zero3.engine.persistent import PersistentGrads
from lightning_zero3.engine.plan import make_plan
from lightning_zero3.engine.record import StepRecord
from lightning_zero3.engine.reduce import Reductions
from lightning_zero3.engine.reshard import resolve
from lightning_zero3.engine.schedule import Schedule
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.stats import ModelStats
from lightning_zero3.engine.unit import Unit


class ShardedModel:
    """Shards `module`'s parameters 1/N over `group` and drives gather/reduce with hooks. Public:
    `module`, `config`, `device` and the methods below (docs/design.md, The engine's surface);
    its collaborators are private, read only inside engine/."""

    def __init__(
        self,
        module: nn.Module,
        config: ShardingConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        sync_module_states: bool = True,
        timeout: timedelta | None = None,
        **options: Any,
    ) -> None:
        """Options in `config` or as keyword arguments; `group` replaces the world (not with `shard_size`)."""
        if config is None:
            config = ShardingConfig(**options)
        elif options:
            raise ValueError(f"Pass options either in `config` or as keyword arguments, not both: {sorted(options)}.")
        self.config = config
        self.module = module
        group, replicate_group = group, None
        if config.shard_size is not None:
            if group is not None:
                raise ValueError("Pass either group or shard_size to ShardedModel, not both.")
            group, replicate_group = hybrid_groups(config.shard_size, timeout)
        real = (t.device for t in [*module.parameters(), *module.buffers()] if not t.is_meta)
        target = indexed(device) if device is not None else next(real, torch.device("cpu"))  # "cuda" -> "cuda:0"
        # Weights move in the shard group, gradients across `replicate_comm` too, G's slices in `slice_comm`.
        self._pool = BufferPool()
        self._comm = Comm(group, pool=self._pool, device=target, quantization=config.quantization)
        replicate = (
            Comm(replicate_group, pool=self._pool, device=target, quantization=config.quantization)
            if replicate_group is not None
            else None
        )  # quantized gradients cross groups quantized too
        self._replicate_comm = replicate
        self._reshard = resolve(config.reshard_after_forward, shard_group=self._comm.world_size)
        group_of_g = consecutive_group(self._reshard, timeout) if type(self._reshard) is int else None  # collective
        self._slice_comm = Comm(group_of_g, pool=self._pool, device=target) if group_of_g is not None else None
        self._world_comm = Comm(None, device=target)  # control traffic: broadcasts, order check, edits
        restore_if_left_sharded(module, world_comm=self._world_comm, device=target)
        self._plan = make_plan(
            module, config.wrap_policy, config.persistence_threshold, shard_group_size=self._comm.world_size
        )
        shards = shard_parameters(
            module,
            self._plan,
            comm=self._comm,
            world_comm=self._world_comm,
            device=target,
            param_init_fn=config.param_init_fn,
            sync_module_states=sync_module_states,
            on_host=config.offload is not None,
        )
        self._record = StepRecord()
        groups = self._replicate_comm.world_size if self._replicate_comm is not None else 1
        self._checks = RankChecks(
            rank=self._comm.rank,
            names=[u.name for u in self._plan.units],
            rank_checks=config.rank_checks,
            groups=groups,
        )
        self._offload = HostOffload(device=target) if config.offload is not None else None
        self._units = [
            Unit(
                uid=uid,
                name=unit_plan.name,
                module=unit_plan.module,
                params=[shards[id(entry)] for entry in unit_plan.params],
                comm=self._comm,
                checks=self._checks,
                replicate=self._replicate_comm,
                param_dtype=config.param_dtype,
                reduce_dtype=config.reduce_dtype,
                record=self._record,
                slice_comm=self._slice_comm,
                offload=self._offload,
            )
            for uid, unit_plan in enumerate(self._plan.units)
        ]
        self.device = target  # the compute device (with offload the shards are on the host)
        self._by_param: dict[int, ShardedParam] = {id(s.param): s for s in shards.values()}
        directory, rank = config.offload_dir, self._world_comm.rank
        self._disk = DiskState(directory, rank=rank, lookup=self.sharded_param) if directory is not None else None
        # Read from the module: materialising may have replaced the parameter objects.
        owners = (e.owners[0] for e in self._plan.persistent)
        self._persistent: list[nn.Parameter] = cast(list[nn.Parameter], [m._parameters[a] for m, a in owners])
        # Averaged over every rank (persistent.py); with shard groups counted as traffic across them.
        persistent_comm = self._comm
        if self._replicate_comm is not None:
            persistent_comm = Comm(None, pool=self._pool, device=target, stats=self._replicate_comm.stats)
        self._persistent_grads = PersistentGrads(self._persistent, persistent_comm)
        self._comm.describe_step = self._describe_step
        self._reductions_in_flight = config.in_flight(target.type)
        self._schedule = Schedule(config.prefetch)
        reductions = Reductions(
            in_flight=self._reductions_in_flight,
            offload=self._offload,  # buffers.py
            pool=self._pool if stream_api(target) is not None else None,
        )
        self._gradient_sync = GradientSync(
            self._units, reductions=reductions, persistent=self._persistent_grads, record=self._record
        )
        schedule, by_param = self._schedule, self._by_param  # no reference back to this object
        self.stats = ModelStats(
            self._units,
            self._persistent,
            comm=self._comm,
            replicate_comm=self._replicate_comm,
            slice_comm=self._slice_comm,
            world_comm=self._world_comm,
            record=self._record,
            pool=self._pool,
            reshard=self._reshard,
            orders=lambda: (schedule.forward_order, schedule.backward_order),
            sharded_param=lambda param: by_param.get(id(param)),
        )
        self._hooks = HookDriver(
            self._units,
            schedule=self._schedule,
            checks=self._checks,
            grads=self._gradient_sync,
            persistent=self._persistent_grads,
            live=self.stats.units,
            record=self._record,
            world_comm=self._world_comm,
            reshard=self._reshard,
            offload=self._offload,
        )
        kept = lambda: self._hooks.state is PassState.KEPT
        self._synced_generate = install_synced_generate(module, kept, ranks=self._comm.world_size * groups)
        self._reading_own = False  # inside `own_reads` (common/run.py, Note: a module's own state_dict)

    def _describe_step(self) -> str:
        orders = [
            (phase, order)
            for phase, order in (("forward", self._schedule.forward_order), ("backward", self._schedule.backward_order))
            if order
        ]
        if not orders:
            return "No unit order is recorded yet (first step)"
        text = "; ".join(f"{phase} {[self._units[uid].name for uid in order]}" for phase, order in orders)
        return f"The recorded unit order, which every rank must follow: {text}"

    @property
    def sharded_params(self) -> list[ShardedParam]:
        """Every sharded parameter, unit by unit: what a checkpoint reads and writes per shard."""
        return [p for unit in self._units for p in unit.params]

    @property
    def world_comm(self) -> Comm:
        """Every rank, for control traffic: checkpoints agree, broadcast and barrier on it."""
        return self._world_comm

    @property
    def shard_comms(self) -> tuple[Comm, Comm | None]:
        """The shard group's communicator and, with `shard_size`, the one across shard groups."""
        return self._comm, self._replicate_comm

    def sharded_param(self, param: torch.Tensor) -> ShardedParam | None:
        """None for a persistent (whole) parameter."""
        return self._by_param.get(id(param))

    def whole_numel(self, param: torch.Tensor) -> int:
        """Elements of `param` whole (a shard's whole parameter, else `param` itself)."""
        return sharded.numel if (sharded := self.sharded_param(param)) is not None else param.numel()

    def full_numel(self, param: torch.Tensor) -> int:
        """The old name of `whole_numel` (docs/user-guide.md named it until 2026-12); warns, then answers."""
        warnings.warn("ShardedModel.full_numel is now whole_numel; call that.", FutureWarning, stacklevel=2)
        return self.whole_numel(param)

    # ---- gradient sync (accumulate.py, Note: unsynced accumulation) ---------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch (accumulate.py, Note: unsynced accumulation): step and zero_grad after a synced backward."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync takes a bool; got {requires_gradient_sync!r}.")
        self._gradient_sync.requires_sync = requires_gradient_sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally; the setting comes back on exit."""
        before = self._gradient_sync.requires_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)

    def discard_unsynced_gradients(self) -> None:
        """Drop the gradients summed with sync off; zero `.grad` too: it may hold part of them."""
        self._gradient_sync.discard()

    @property
    def gradients_owed(self) -> bool:
        """Whether gradients summed with sync off wait for a synced backward (a save now misses them)."""
        return self._gradient_sync.state is not SyncState.SYNCED

    def mark_final_batch(self, final: bool, *, fix: str = UNEVEN_FIX) -> None:
        """Whether the next step takes this rank's last batch (checks.py, Note: uneven batches): its gathers
        tell the other ranks, so uneven batch counts fail naming `fix` (how to even them)."""
        self._checks.final_batch, self._checks.uneven_fix = final, fix

    # ---- whole parameters outside forward -------------------------------------------------
    def gathered_parameters(
        self, module: nn.Module | None = None, *, modifier_rank: int | None = None
    ) -> AbstractContextManager[None]:
        """The parameters under `module` (default: all) whole on every rank (gathered.py)."""
        scope = module if module is not None else self.module
        return gathered_parameters(
            scope,
            self._units,
            self._persistent,
            checks=self._checks,
            pool=self._pool,
            world_comm=self._world_comm,
            modifier_rank=modifier_rank,
        )

    @contextmanager
    def gathered_for_inference(self) -> Iterator[None]:
        """Every unit gathered for the block (the whole model's parameters per rank, like DDP),
        for inference and `generate()` without a collective per forward; collective; no
        gradients inside (kept.py, Note: kept for inference)."""
        with self._pool.transient():  # buffers.py, Note: what the pool keeps
            self._hooks.keep()
            try:
                yield
            finally:
                self._hooks.release()

    # ---- state dicts ------------------------------------------------------------------------
    @contextmanager
    def own_reads(self) -> Iterator[None]:
        """The module's `state_dict()` read for this rank's shards (a checkpoint, `full_state_dict`)."""
        before, self._reading_own = self._reading_own, True
        try:
            yield
        finally:
            self._reading_own = before

    reading_own = property(lambda self: self._reading_own, doc="Inside `own_reads`: a guard lets reads pass.")

    def full_state_dict(self, *, to_rank: int | None = 0) -> dict[str, torch.Tensor]:
        """`state_dict()` with whole parameters, gathered one unit at a time, in host memory and
        never views of the live module (persistent parameters and buffers copied); with `to_rank`
        only that rank gets them (others an empty dict)."""
        keep = to_rank is None or self._world_comm.rank == to_rank
        whole_by_id: dict[int, torch.Tensor] = {}
        with self.own_reads():
            state = self.module.state_dict()
        with engine_mode(), self._pool.transient():
            for unit in self._units:
                if not unit.params:
                    continue
                if keep:  # host tensors of their own
                    outputs = [torch.empty(p.whole_shape, dtype=unit.shard_dtype) for p in unit.params]
                    unit.gather_into(outputs, dtype=unit.shard_dtype)
                    whole_by_id.update((id(sharded.param), out) for sharded, out in zip(unit.params, outputs))
                else:  # every rank joins the All-Gather
                    unit.release(unit.gather(dtype=unit.shard_dtype))
        self._checks.check()  # outside any pass: check these gathers now
        if not keep:
            return {}
        by_name = {name: whole_by_id[id(s.param)] for s in self.sharded_params for name in s.names}
        own = {
            k: v.detach().to("cpu", copy=True)
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and k not in by_name
        }  # not the shards again
        return {key: by_name.get(key, own.get(key, value)) for key, value in state.items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
        """Load whole tensors (the same on every rank): each rank keeps its slice."""
        shard_keys = {name for p in self.sharded_params for name in p.names}
        rest = {k: v for k, v in state_dict.items() if k not in shard_keys}
        missing = []
        for sharded in self.sharded_params:
            source = next((state_dict[n] for n in sharded.names if n in state_dict), None)
            if source is None:
                missing.append(sharded.name)
                continue
            sharded.load_whole(source)
        result = self.module.load_state_dict(rest, strict=False)
        if strict:
            unexpected = list(result.unexpected_keys)
            absent = missing + [k for k in result.missing_keys if k not in shard_keys]
            if unexpected or absent:
                raise KeyError(
                    f"State dict does not match the model: missing keys {absent[:10]}, unexpected keys "
                    f"{unexpected[:10]}. Load a checkpoint of the same model or pass strict=False."
                )

    def move_module(self, device: torch.device | str) -> None:
        """`module.to(device)`; with offload the shards stay on the host."""
        move_module(self.module, self.sharded_params if self._offload is not None else [], torch.device(device))

    def remove_hooks(self) -> None:
        """Remove the hooks and the synced `generate`; no collective."""
        self._hooks.remove()
        self._gradient_sync.discard()  # and its optimizer-step hook
        remove_synced_generate(self._synced_generate)
        if self._disk is not None:
            self._disk.close()
        if self._offload is not None:
            self._offload.close()  # the device copies of the shards

    def restore_module(self, *, device: torch.device | str = "cpu") -> None:
        """Make `module` an ordinary module on `device` again (Note: restoring unit by unit).
        Collective. This object stays valid for reading (`stats`, sharded state), not training."""
        self.remove_hooks()
        with engine_mode():
            restore_whole(self._units, device=torch.device(device))
        self.module.to(device)
        forget(self.module)
        self.release_buffers()

    def release_buffers(self) -> None:
        """Pooled buffers back to the allocator; the next step makes them again. No collective."""
        self._pool.empty()

    def rest(self) -> None:
        """Free what the next step makes again (gradients, buffers, offload's device copies); no collective."""
        for sharded in self.sharded_params:
            sharded.param.grad = None
        if self._offload is not None:
            self._offload.close()
        self.release_buffers()

    def leave_sharded(self, *, fix: str = SHARD_AGAIN) -> None:
        """Hooks off, buffers freed, shards kept; a forward then raises naming `fix` (Note: a module left sharded)."""
        self.remove_hooks()
        self.release_buffers()
        leave_sharded(self.module, self, fix)
