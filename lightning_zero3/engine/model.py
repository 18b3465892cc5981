"""`ShardedModel`: ZeRO stage 3 on a bare `nn.Module`. Framework-independent.

    sharded = ShardedModel(model, prefetch=1)      # model's parameters are now 1/N shards
    optimizer = torch.optim.AdamW(model.parameters())
    loss = model(x).mean(); loss.backward()         # gathers, reduce-scatters, prefetches
    sharded.clip_grad_norm_(1.0); optimizer.step()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero3.engine import accounting
from lightning_zero3.engine.accumulate import GradientSync
from lightning_zero3.engine.buffers import BufferPool, indexed
from lightning_zero3.engine.calls import PassState, engine_mode
from lightning_zero3.engine.checks import RankChecks
from lightning_zero3.engine.comm import Comm, CommStats, consecutive_group, hybrid_groups
from lightning_zero3.engine.config import ShardingConfig
from lightning_zero3.engine.disk import DiskState
from lightning_zero3.engine.gathered import gathered_parameters
from lightning_zero3.engine.generation import install_synced_generate, remove_synced_generate
from lightning_zero3.engine.hooks import HookDriver
from lightning_zero3.engine.left_sharded import forget, leave_sharded, restore_if_left_sharded
from lightning_zero3.engine.materialize import restore_whole, shard_parameters
from lightning_zero3.engine.offload import HostOffload, move_module
from lightning_zero3.engine.persistent import PersistentGrads
from lightning_zero3.engine.plan import make_plan
from lightning_zero3.engine.record import Step, StepRecord, UnitStats
from lightning_zero3.engine.reduce import Reductions
from lightning_zero3.engine.reshard import resolve
from lightning_zero3.engine.schedule import Schedule
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.unit import Unit


class ShardedModel:
    """Shards `module`'s parameters 1/N over `group` and drives gather/reduce with hooks."""

    def __init__(
        self, module: nn.Module, config: ShardingConfig | None = None, *, group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None, sync_module_states: bool = True, **options: Any,
    ) -> None:  # fmt: skip
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
            group, replicate_group = hybrid_groups(config.shard_size)
        real = (t.device for t in [*module.parameters(), *module.buffers()] if not t.is_meta)
        target = indexed(device) if device is not None else next(real, torch.device("cpu"))  # "cuda" -> "cuda:0"
        # Parameter data moves in the shard group; with `shard_size` gradients are also averaged
        # across `replicate_comm`, and with reshard_after_forward=G slices move in `slice_comm`.
        self.pool = BufferPool()
        self.comm = Comm(group, pool=self.pool, device=target)
        replicate = Comm(replicate_group, pool=self.pool, device=target) if replicate_group is not None else None
        self.replicate_comm = replicate
        self.reshard = resolve(config.reshard_after_forward, shard_group=self.comm.world_size)
        group_of_g = consecutive_group(self.reshard) if type(self.reshard) is int else None  # collective
        self.slice_comm = Comm(group_of_g, pool=self.pool, device=target) if group_of_g is not None else None
        self.world_comm = Comm(None, device=target)  # control traffic: broadcasts, order check, edits
        restore_if_left_sharded(module, world_comm=self.world_comm, device=target)
        self.plan = make_plan(module, config.wrap_policy, config.persistence_threshold,
                              shard_group_size=self.comm.world_size)  # fmt: skip
        shards = shard_parameters(
            module, self.plan, comm=self.comm, world_comm=self.world_comm, device=target,
            param_init_fn=config.param_init_fn, sync_module_states=sync_module_states,
            on_host=config.offload is not None,
        )  # fmt: skip
        self.record = StepRecord()
        self.unit_stats = UnitStats()
        groups = self.replicate_comm.world_size if self.replicate_comm is not None else 1
        self.checks = RankChecks(rank=self.comm.rank, names=[u.name for u in self.plan.units],
                                 rank_checks=config.rank_checks, groups=groups)  # fmt: skip
        self.units = [
            Unit(uid=uid, name=unit_plan.name, module=unit_plan.module,
                 params=[shards[id(entry)] for entry in unit_plan.params], comm=self.comm, checks=self.checks,
                 replicate=self.replicate_comm, param_dtype=config.param_dtype,
                 reduce_dtype=config.reduce_dtype, record=self.record,
                 slice_comm=self.slice_comm)  # fmt: skip
            for uid, unit_plan in enumerate(self.plan.units)
        ]
        self.device = target  # the compute device (with offload the shards are on the host)
        self.offload = HostOffload(self.units, device=target) if config.offload is not None else None
        self._by_param: dict[int, ShardedParam] = {id(s.param): s for s in shards.values()}
        directory, rank = config.offload_dir, self.world_comm.rank
        self.disk = DiskState(directory, rank=rank, lookup=self.sharded_param) if directory is not None else None
        # Read from the module: materialising may have replaced the parameter objects.
        owners = (e.owners[0] for e in self.plan.persistent)
        self.persistent: list[nn.Parameter] = cast(list[nn.Parameter], [m._parameters[a] for m, a in owners])
        # Averaged over every rank (persistent.py); with shard groups counted as traffic across them.
        persistent_comm = self.comm
        if self.replicate_comm is not None:
            persistent_comm = Comm(None, pool=self.pool, device=target, stats=self.replicate_comm.stats)
        self.persistent_grads = PersistentGrads(self.persistent, persistent_comm)
        self.comm.describe_step = self._describe_step
        in_flight = config.reductions_in_flight
        self.reductions_in_flight = in_flight if in_flight is not None else 2 * (target.type == "cuda")
        self.schedule = Schedule(config.prefetch)
        reductions = Reductions(in_flight=self.reductions_in_flight, offload=self.offload)
        self.gradient_sync = GradientSync(self.units, reductions=reductions, persistent=self.persistent_grads,
                                          record=self.record)  # fmt: skip
        self.hooks = HookDriver(
            self.units, schedule=self.schedule, checks=self.checks, grads=self.gradient_sync,
            persistent=self.persistent_grads, live=self.unit_stats,
            record=self.record, world_comm=self.world_comm, reshard=self.reshard,
        )  # fmt: skip
        held = lambda: self.hooks.state is PassState.HELD
        self._synced_generate = install_synced_generate(module, held, ranks=self.comm.world_size * groups)

    def _describe_step(self) -> str:
        orders = [(phase, order) for phase, order in (("forward", self.schedule.forward_order),
                                                      ("backward", self.schedule.backward_order)) if order]
        if not orders:
            return "No unit order is recorded yet (first step)"
        text = "; ".join(f"{phase} {[self.units[uid].name for uid in order]}" for phase, order in orders)
        return f"The recorded unit order, which every rank must follow: {text}"

    # ---- lookups ----------------------------------------------------------------------------
    @property
    def sharded_params(self) -> list[ShardedParam]:
        return [p for unit in self.units for p in unit.params]

    def sharded_param(self, param: torch.Tensor) -> ShardedParam | None:
        """None for a persistent (whole) parameter."""
        return self._by_param.get(id(param))

    def full_numel(self, param: torch.Tensor) -> int:
        sharded = self.sharded_param(param)
        return sharded.numel if sharded is not None else param.numel()

    @property
    def stats(self) -> CommStats:
        """Traffic inside the shard group (the whole world unless `shard_size` is set)."""
        return self.comm.stats

    @property
    def replicate_stats(self) -> CommStats | None:
        """Traffic across shard groups (hierarchical sharding only)."""
        return self.replicate_comm.stats if self.replicate_comm is not None else None

    @property
    def slice_stats(self) -> CommStats | None:
        """Traffic inside the groups of G (`reshard_after_forward=G` only)."""
        return self.slice_comm.stats if self.slice_comm is not None else None

    def end_step(self) -> None:
        """Close the step: `stats.last_step` and `last_step_record` become this step's."""
        for comm in (self.comm, self.replicate_comm, self.slice_comm, self.world_comm):
            if comm is not None:
                comm.stats.end_step()
        self.record.end_step()

    @property
    def last_step_record(self) -> Step | None:
        return self.record.last

    def last_step_expected_bytes(self, *, across_groups: bool = False, slices: bool = False) -> dict[str, int] | None:
        """The formula (accounting.py) for the step `stats.last_step` measured, with the orders
        and passes it ran with; None before any `end_step`."""
        last = self.record.last
        if last is None:
            return None
        passes = {"micro_batches": last.backwards, "synced": last.synced} if last.backwards else {}
        return accounting.expected_step_bytes(self.units, self.persistent, orders=last.orders, reshard=self.reshard,
                                              across_groups=across_groups, slices=slices, **passes)  # fmt: skip

    @property
    def global_rank(self) -> int:
        return self.world_comm.rank

    def reset_peaks(self) -> None:
        self.unit_stats.reset_peaks()

    # ---- gradient sync (accumulate.py, Note: unsynced accumulation) ---------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch (accumulate.py, Note: unsynced accumulation): step and zero_grad only
        after a backward with sync on."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync takes a bool; got {requires_gradient_sync!r}.")
        self.gradient_sync.requires_sync = requires_gradient_sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally; the setting comes back on exit."""
        before = self.gradient_sync.requires_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)

    def discard_unsynced_gradients(self) -> None:
        """Drop the gradients summed with sync off; zero `.grad` too: it may hold part of them."""
        self.gradient_sync.discard()

    # ---- whole parameters outside forward -------------------------------------------------
    def gathered_parameters(
        self, module: nn.Module | None = None, *, modifier_rank: int | None = None
    ) -> AbstractContextManager[None]:
        """The parameters under `module` (default: all) whole on every rank (gathered.py)."""
        scope = module if module is not None else self.module
        return gathered_parameters(scope, self.units, self.persistent, checks=self.checks,
                                   world_comm=self.world_comm, modifier_rank=modifier_rank)  # fmt: skip

    @contextmanager
    def gathered_for_inference(self) -> Iterator[None]:
        """Every unit gathered for the block (the whole model's parameters per rank, like DDP),
        for inference and `generate()` without a collective per forward; collective; no
        gradients inside (held.py, Note: held for inference)."""
        self.hooks.hold()
        try:
            yield
        finally:
            self.hooks.release()

    # ---- state dicts ------------------------------------------------------------------------
    def full_state_dict(self, *, to_rank: int | None = 0) -> dict[str, torch.Tensor]:
        """`state_dict()` with whole parameters, gathered one unit at a time, in host memory and
        never views of the live module (persistent parameters and buffers copied); with `to_rank`
        only that rank gets them (others an empty dict)."""
        keep = to_rank is None or self.global_rank == to_rank
        full_by_id: dict[int, torch.Tensor] = {}
        state = self.module.state_dict()
        with engine_mode():
            for unit in self.units:
                if not unit.params:
                    continue
                if keep:  # host tensors of their own
                    outputs = [torch.empty(p.full_shape, dtype=unit.shard_dtype) for p in unit.params]
                    unit.gather_into(outputs, dtype=unit.shard_dtype)
                    full_by_id.update((id(sharded.param), out) for sharded, out in zip(unit.params, outputs))
                else:  # every rank joins the All-Gather
                    unit.release(unit.gather(dtype=unit.shard_dtype))
        self.checks.check()  # outside any pass: check these gathers now
        if not keep:
            return {}
        by_name = {name: full_by_id[id(s.param)] for s in self.sharded_params for name in s.names}
        own = {k: v.detach().to("cpu", copy=True) for k, v in state.items() if isinstance(v, torch.Tensor)}
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
            sharded.load_full(source)
        result = self.module.load_state_dict(rest, strict=False)
        if strict:
            unexpected = list(result.unexpected_keys)
            absent = missing + [k for k in result.missing_keys if k not in shard_keys]
            if unexpected or absent:
                raise KeyError(
                    f"State dict does not match the model: missing keys {absent[:10]}, unexpected keys "
                    f"{unexpected[:10]}. Load a checkpoint of the same model or pass strict=False."
                )

    # ---- model-state accounting (accounting.py) -------------------------------------------
    def model_state_bytes(self, optimizers: list[torch.optim.Optimizer] | None = None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds between steps."""
        return accounting.model_state_bytes([p.param for p in self.sharded_params] + self.persistent, optimizers)

    def expected_step_bytes(self, *, across_groups: bool = False, slices: bool = False) -> dict[str, int]:
        """The formula (accounting.py) for a training step with the unit orders recorded now."""
        orders = (self.schedule.forward_order, self.schedule.backward_order)
        return accounting.expected_step_bytes(self.units, self.persistent, orders=orders, reshard=self.reshard,
                                              across_groups=across_groups, slices=slices)  # fmt: skip

    def move_module(self, device: torch.device | str) -> None:
        """`module.to(device)`; with offload the shards stay on the host."""
        move_module(self.module, self.sharded_params if self.offload is not None else [], torch.device(device))

    def remove_hooks(self) -> None:
        """Remove the hooks and the synced `generate`; no collective."""
        self.hooks.remove()
        self.gradient_sync.discard()  # and its optimizer-step hook
        remove_synced_generate(self._synced_generate)
        if self.disk is not None:
            self.disk.close()
        if self.offload is not None:
            self.offload.close()  # the device copies of the shards

    def restore_module(self, *, device: torch.device | str = "cpu") -> None:
        """Make `module` an ordinary module on `device` again (Note: restoring unit by unit).
        Collective. This object stays valid for reading (`stats`, sharded state), not training."""
        self.remove_hooks()
        with engine_mode():
            restore_whole(self.units, device=torch.device(device))
        self.module.to(device)
        forget(self.module)

    def leave_sharded(self) -> None:
        """Remove the hooks, keep the shards; no collective (Note: a module left sharded)."""
        self.remove_hooks()
        leave_sharded(self.module, self)
