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
from lightning_zero3.engine.buffers import BufferPool
from lightning_zero3.engine.calls import PassState, engine_mode
from lightning_zero3.engine.checks import RankChecks
from lightning_zero3.engine.comm import Comm, CommStats, hybrid_groups
from lightning_zero3.engine.config import ShardingConfig
from lightning_zero3.engine.disk import DiskState
from lightning_zero3.engine.gathered import gathered_parameters
from lightning_zero3.engine.generation import install_synced_generate, remove_synced_generate
from lightning_zero3.engine.hooks import HookDriver
from lightning_zero3.engine.left_sharded import forget, leave_sharded, restore_if_left_sharded
from lightning_zero3.engine.materialize import restore_whole, shard_parameters
from lightning_zero3.engine.offload import HostOffload, OffloadHooks, move_module
from lightning_zero3.engine.persistent import PersistentGrads
from lightning_zero3.engine.plan import make_plan
from lightning_zero3.engine.record import LiveUnits, Step, StepRecord, UnitStats
from lightning_zero3.engine.reduce import Reductions
from lightning_zero3.engine.reshard import resolve, slice_group
from lightning_zero3.engine.schedule import Schedule
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.unit import Unit


def _device_of(module: nn.Module, device: torch.device | str | None) -> torch.device:
    """Where meta tensors are materialised: `device`, else where the module's real tensors are."""
    if device is not None:
        return torch.device(device)
    for t in [*module.parameters(), *module.buffers()]:
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


class ShardedModel:
    """Shards `module`'s parameters 1/N over `group` and drives gather/reduce with hooks."""

    def __init__(
        self,
        module: nn.Module,
        config: ShardingConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        sync_module_states: bool = True,
        **options: Any,
    ) -> None:
        """`config` holds every option (config.py); `ShardedModel(module, prefetch=2)` builds one
        from keyword arguments instead. `group` replaces the world (not with `shard_size`)."""
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
        target = _device_of(module, device)
        # Collectives on parameter data run in the shard group (the whole world by default);
        # with hierarchical sharding, gradients are also averaged across `replicate_comm`.
        # Transient buffers (gathers, reductions, full parameters) are reused from here.
        self.pool = BufferPool()
        self.comm = Comm(group, pool=self.pool, device=target)
        self.replicate_comm = (
            Comm(replicate_group, pool=self.pool, device=target) if replicate_group is not None else None
        )
        # reshard_after_forward=G: the groups of G ranks that gather the slices kept after
        # forward (reshard.py), their traffic counted apart from the shard group's.
        self.reshard = resolve(config.reshard_after_forward, shard_group=self.comm.world_size)
        group_of_g = slice_group(self.reshard)
        self.slice_comm = Comm(group_of_g, pool=self.pool, device=target) if group_of_g is not None else None
        # Control traffic that must reach every rank: initial broadcast, order check, edits.
        self.world_comm = Comm(None, device=target)
        # Shards left by an earlier engine whose run failed are made whole first (Note: a module left sharded).
        restore_if_left_sharded(module, world_comm=self.world_comm, device=target)
        self.plan = make_plan(
            module, config.wrap_policy, config.persistence_threshold, shard_group_size=self.comm.world_size
        )
        shards = shard_parameters(
            module, self.plan, comm=self.comm, world_comm=self.world_comm, device=target,
            param_init_fn=config.param_init_fn, sync_module_states=sync_module_states,
            on_host=config.offload is not None,
        )  # fmt: skip
        # What each step gathered, kept and reduced (record.py), and the units alive.
        self.record = StepRecord()
        self.unit_stats = UnitStats()
        self.live = LiveUnits(len(self.plan.units), self.unit_stats)
        groups = self.replicate_comm.world_size if self.replicate_comm is not None else 1
        self.checks = RankChecks(rank=self.comm.rank, names=[u.name for u in self.plan.units],
                                 every=config.check_every, groups=groups)  # fmt: skip
        self.units = [
            Unit(uid=uid, name=unit_plan.name, module=unit_plan.module,
                 params=[shards[id(entry)] for entry in unit_plan.params], comm=self.comm, checks=self.checks,
                 replicate=self.replicate_comm, param_dtype=config.param_dtype,
                 reduce_dtype=config.reduce_dtype, pool=self.pool, record=self.record,
                 slice_comm=self.slice_comm)  # fmt: skip
            for uid, unit_plan in enumerate(self.plan.units)
        ]
        # The compute device; with offload the shards are in host memory (offload.py, Note: host offload).
        self.device = target
        self.offload = HostOffload(self.units, device=target) if config.offload is not None else None
        self._by_param: dict[int, ShardedParam] = {id(s.param): s for s in shards.values()}
        # Optimizer state of the shards in files under `offload_dir` (disk.py), until `remove_hooks`.
        directory, rank = config.offload_dir, self.world_comm.rank
        self.disk = DiskState(directory, rank=rank, lookup=self.sharded_param) if directory is not None else None
        # Read from the module: materialising may have replaced the parameter objects.
        # The plan lists registered parameters only, never a None slot.
        owners = (e.owners[0] for e in self.plan.persistent)
        self.persistent: list[nn.Parameter] = cast(list[nn.Parameter], [m._parameters[a] for m, a in owners])
        # Their gradients are averaged over every rank in one All-Reduce. With shard groups that
        # is a collective over the whole world, counted with the traffic across groups.
        persistent_comm = self.comm
        if self.replicate_comm is not None:
            persistent_comm = Comm(None, pool=self.pool, device=target, stats=self.replicate_comm.stats)
        self.persistent_grads = PersistentGrads(self.persistent, persistent_comm)
        self.comm.describe_step = self._describe_step
        # Reduce-Scatters left running while backward continues (reduce.py, Note: asynchronous
        # reduction); each holds one unit's full gradient buffer. None: 2 on CUDA, where they
        # run on their own stream, 0 elsewhere (no gain measured on CPU/gloo).
        in_flight = config.reductions_in_flight
        self.reductions_in_flight = in_flight if in_flight is not None else 2 * (target.type == "cuda")
        self.schedule = Schedule(config.prefetch)
        # Reduces each backward's gradients, or sums them while sync is off (accumulate.py).
        reductions = Reductions(in_flight=self.reductions_in_flight, offload=self.offload)
        self.gradient_sync = GradientSync(self.units, reductions=reductions, persistent=self.persistent_grads,
                                          record=self.record)  # fmt: skip
        driver = HookDriver if self.offload is None else OffloadHooks
        self.hooks = driver(
            self.units, schedule=self.schedule, checks=self.checks, grads=self.gradient_sync,
            persistent=self.persistent_grads, live=self.live,
            record=self.record, world_comm=self.world_comm, reshard=self.reshard,
        )  # fmt: skip
        # HF generate() outside gathered_for_inference() keeps the ranks in step by default
        # (generation.py, Note: synced generation by default).
        ranks = self.comm.world_size * groups
        self._synced_generate = install_synced_generate(
            module, lambda: self.hooks.state is PassState.HELD, ranks=ranks
        )

    def _describe_step(self) -> str:
        orders = [(phase, order) for phase, order in (("forward", self.schedule.forward_order),
                                                      ("backward", self.schedule.backward_order)) if order]
        if not orders:
            return "No unit order is recorded yet (first step)"
        text = "; ".join(f"{phase} {[self.units[uid].name for uid in order]}" for phase, order in orders)
        return f"The recorded unit order, which every rank must follow: {text}"

    def check_tags(self) -> None:
        """Raise `OrderMismatchError` if any collective since the last check met another unit
        on some rank (checks.py). The hooks call it at the end of backward and when a pass begins."""
        self.checks.check()

    # ---- lookups ----------------------------------------------------------------------------
    @property
    def sharded_params(self) -> list[ShardedParam]:
        return [p for unit in self.units for p in unit.params]

    def sharded_param(self, param: torch.Tensor) -> ShardedParam | None:
        """The bookkeeping of a registered shard, or None for a persistent (whole) parameter."""
        return self._by_param.get(id(param))

    def full_numel(self, param: torch.Tensor) -> int:
        """Elements of the whole parameter behind `param` (a shard or a persistent parameter)."""
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
        """Traffic inside the groups of G (`reshard_after_forward=G` only): backward's gathers."""
        return self.slice_comm.stats if self.slice_comm is not None else None

    def end_step(self) -> None:
        """Close the step's accounting: `stats.last_step` becomes this step's traffic and
        `last_step_record` what the engine gathered, kept and reduced in it (record.py)."""
        self.comm.stats.end_step()
        for comm in (self.replicate_comm, self.slice_comm):
            if comm is not None:
                comm.stats.end_step()
        self.world_comm.stats.end_step()
        self.record.end_step()

    @property
    def last_step_record(self) -> Step | None:
        """What the last step closed by `end_step` gathered, kept and reduced, by unit id."""
        return self.record.last

    def last_step_expected_bytes(self, *, across_groups: bool = False, slices: bool = False) -> dict[str, int] | None:
        """The formula (accounting.py) for the step `stats.last_step` measured, with the record
        of unit orders, backwards and synced backwards that step ran with; None before any `end_step`."""
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
        self.live.reset_peaks()

    # ---- gradient sync (accumulate.py, Note: unsynced accumulation) ---------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch. False: each backward adds every unit's full (unsharded) gradients into a
        buffer (fp32, 4 bytes per parameter on every rank) and sends nothing; True (default): the
        next backward adds its own and reduces the sums once. Call `optimizer.step()` and
        `zero_grad()` only after that backward: both are refused while sums are owed."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync takes a bool; got {requires_gradient_sync!r}.")
        self.gradient_sync.requires_sync = requires_gradient_sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally; the setting before the block comes back on exit."""
        before = self.gradient_sync.requires_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)

    def discard_unsynced_gradients(self) -> None:
        """Drop the gradients summed with sync off (after a backward that raised, or to start
        over); zero `.grad` too (`optimizer.zero_grad()`): it may hold part of them."""
        self.gradient_sync.discard()

    # ---- whole parameters outside forward -------------------------------------------------
    def gathered_parameters(
        self, module: nn.Module | None = None, *, modifier_rank: int | None = None
    ) -> AbstractContextManager[None]:
        """Make the parameters under `module` (default: all) whole on every rank (gathered.py)."""
        scope = module if module is not None else self.module
        return gathered_parameters(scope, self.units, self.persistent, checks=self.checks,
                                   world_comm=self.world_comm, modifier_rank=modifier_rank)  # fmt: skip

    @contextmanager
    def gathered_for_inference(self) -> Iterator[None]:
        """Keep every unit gathered for the whole block, for fast inference and `generate()`:
        one All-Gather per unit on entry (on every rank, collective), none per forward inside,
        and every unit sharded again on exit, even if the block raises. Needs memory for the
        whole model's parameters on each rank (in `param_dtype`), like DDP. Only forwards under
        `torch.no_grad()` / `torch.inference_mode()` may run inside (held.py, Note: held for
        inference); a rank whose generation stops early issues no collective the others wait
        for, so `generate(synced_gpus=False)` is safe inside."""
        self.hooks.hold()
        try:
            yield
        finally:
            self.hooks.release()

    # ---- state dicts ------------------------------------------------------------------------
    def full_state_dict(self, *, to_rank: int | None = 0) -> dict[str, torch.Tensor]:
        """The module's `state_dict()` with whole parameters, gathered one unit at a time. With
        `to_rank`, only that rank keeps the gathered tensors (others get an empty dict)."""
        keep = to_rank is None or self.global_rank == to_rank
        full_by_id: dict[int, torch.Tensor] = {}
        state = self.module.state_dict()
        with engine_mode():  # Note: inference mode (calls.py): the blocks go back to the pool
            for unit in self.units:
                if not unit.params:
                    continue
                if keep:  # host tensors of their own; the gathered block goes back to the pool
                    outputs = [torch.empty(p.full_shape, dtype=unit.shard_dtype) for p in unit.params]
                    unit.gather_into(outputs, dtype=unit.shard_dtype)
                    full_by_id.update((id(sharded.param), out) for sharded, out in zip(unit.params, outputs))
                else:  # every rank joins the All-Gather
                    unit.release(unit.gather(dtype=unit.shard_dtype))
        self.checks.check()  # outside any pass: check the tags of these gathers now
        if not keep:
            return {}
        by_name = {}
        for sharded in self.sharded_params:
            for name in sharded.names:
                by_name[name] = full_by_id[id(sharded.param)]
        return {key: by_name.get(key, value) for key, value in state.items()}

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
        # Shard entries are handled above; torch loads buffers and persistent parameters.
        result = self.module.load_state_dict(rest, strict=False)
        if strict:
            unexpected = [k for k in result.unexpected_keys]
            absent = missing + [k for k in result.missing_keys if k not in shard_keys]
            if unexpected or absent:
                raise KeyError(
                    f"State dict does not match the model: missing keys {absent[:10]}, unexpected keys "
                    f"{unexpected[:10]}. Load a checkpoint of the same model or pass strict=False."
                )

    # ---- model-state accounting (accounting.py) -------------------------------------------
    def model_state_bytes(self, optimizers: list[torch.optim.Optimizer] | None = None) -> dict[str, int]:
        """Bytes of model state this rank holds between steps: parameter shards (and persistent
        parameters), gradient shards, and optimizer state for them."""
        return accounting.model_state_bytes([p.param for p in self.sharded_params] + self.persistent, optimizers)

    def expected_step_bytes(self, *, across_groups: bool = False, slices: bool = False) -> dict[str, int]:
        """The formula (accounting.py) for a training step with the unit orders recorded now."""
        orders = (self.schedule.forward_order, self.schedule.backward_order)
        return accounting.expected_step_bytes(self.units, self.persistent, orders=orders, reshard=self.reshard,
                                              across_groups=across_groups, slices=slices)  # fmt: skip

    def move_module(self, device: torch.device | str) -> None:
        """`module.to(device)`; with offload the shards stay in host memory (offload.py)."""
        move_module(self.module, self.sharded_params if self.offload is not None else [], torch.device(device))

    def remove_hooks(self) -> None:
        """Remove the hooks (`HookDriver.remove` first closes the calls still holding full
        parameters; no collective) and the synced `generate` (generation.py)."""
        self.hooks.remove()
        self.gradient_sync.discard()  # and its optimizer-step hook
        remove_synced_generate(self._synced_generate)
        if self.disk is not None:
            self.disk.close()
        if self.offload is not None:
            self.offload.close()  # the device copies of the shards

    def restore_module(self, *, device: torch.device | str = "cpu") -> None:
        """Make `module` an ordinary module again, on `device`: whole parameters (gathered one
        unit at a time, Note: restoring unit by unit), persistent parameters and buffers moved
        there, hooks removed. Collective: call it on every rank. The shards and this object stay
        valid for reading (`stats`, the optimizer's sharded state), not for training."""
        self.remove_hooks()
        with engine_mode():  # whole parameters that can train; pool blocks that can be reused
            restore_whole(self.units, device=torch.device(device))
        self.module.to(device)
        forget(self.module)

    def leave_sharded(self) -> None:
        """Remove the hooks, keep the shards in the module, no collective (after a failure: other
        ranks may be gone). Note: a module left sharded; this object can still save the shards."""
        self.remove_hooks()
        leave_sharded(self.module, self)
