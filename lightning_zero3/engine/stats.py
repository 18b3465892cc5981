"""`ModelStats`, a `ShardedModel`'s accounting behind one object (`sharded.stats`): the bytes
each process group moved (comm.py's `CommStats`), what the last step did (record.py), the units
gathered now and at most, and beside them the formula for them (accounting.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_zero3.engine import accounting
from lightning_zero3.engine.buffers import BufferPool
from lightning_zero3.engine.comm import Comm, CommStats
from lightning_zero3.engine.record import Orders, Step, StepRecord, UnitStats
from lightning_zero3.engine.shard import ShardedParam
from lightning_zero3.engine.unit import Unit
from lightning_zero3.engine.whole_matrix import whole_matrix_step_bytes


class ModelStats:
    """Counters and formulas of one `ShardedModel`; it reads the engine, never changes what it does."""

    def __init__(
        self,
        units: list[Unit],
        persistent: Sequence[torch.Tensor],
        *,
        comm: Comm,
        replicate_comm: Comm | None,
        slice_comm: Comm | None,
        world_comm: Comm,
        record: StepRecord,
        pool: BufferPool,
        reshard: bool | int,
        orders: Callable[[], Orders],
        sharded_param: Callable[[torch.Tensor], ShardedParam | None],
    ) -> None:
        self._units, self._persistent = units, persistent
        self._comms = (comm, replicate_comm, slice_comm, world_comm)
        self._record, self._pool, self._reshard = record, pool, reshard
        self._orders, self._sharded_param = orders, sharded_param  # the orders recorded now; a parameter's shard
        self.units = UnitStats()  # units gathered now and at most (invariant 4), moved by the hooks
        self.shard_group: CommStats = comm.stats  # inside the shard group (the world unless `shard_size`)
        self.across_groups: CommStats | None = replicate_comm.stats if replicate_comm is not None else None
        self.slice_groups: CommStats | None = slice_comm.stats if slice_comm is not None else None  # G of reshard
        self.control: CommStats = world_comm.stats  # scalars on the world: inf flags, agreements, order checks

    def end_step(self) -> None:
        """Close the step: every group's `last_step` and `last_step_record` become this step's."""
        for comm in filter(None, self._comms):
            comm.stats.end_step()
        self._record.end_step()

    def forget_traffic(self) -> None:
        """Drop the traffic counted in the groups since the last `end_step` (e.g. evaluation's)."""
        for stats in filter(None, (self.shard_group, self.across_groups)):
            stats.current.clear()

    @property
    def last_step_record(self) -> Step | None:
        """What the last step did (units gathered, kept, reduced; record.py); None before `end_step`."""
        return self._record.last

    def reset_peaks(self) -> None:
        """Start the units' peaks afresh (e.g. when training starts after evaluation)."""
        self.units.reset_peaks()

    def expected_step_bytes(self, *, across_groups: bool = False, slices: bool = False) -> dict[str, int]:
        """The formula (accounting.py) for a training step with the unit orders recorded now."""
        return accounting.expected_step_bytes(
            self._units,
            self._persistent,
            orders=self._orders(),
            reshard=self._reshard,
            across_groups=across_groups,
            slices=slices,
        )

    def last_step_expected_bytes(self, *, across_groups: bool = False, slices: bool = False) -> dict[str, int] | None:
        """The formula for the step `shard_group.last_step` measured; None before any `end_step`."""
        last = self._record.last
        if last is None:
            return None
        passes = {"micro_batches": last.backwards, "synced": last.synced} if last.backwards else {}
        return accounting.expected_step_bytes(
            self._units,
            self._persistent,
            orders=last.orders,
            reshard=self._reshard,
            across_groups=across_groups,
            slices=slices,
            **passes,
        )

    def model_state_bytes(self, optimizers: list[torch.optim.Optimizer] | None = None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds between steps."""
        params = [p.param for unit in self._units for p in unit.params] + list(self._persistent)
        return accounting.model_state_bytes(params, optimizers)

    def report(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """What this rank holds and sends (`ZeRO3Strategy.stats`, docs/accounting.md): the last
        step's measured bytes next to the formula for it (the last step's, else the next one's)."""
        measured = lambda stats: {k: vars(b).copy() for k, b in stats.last_step.items()} if stats is not None else {}
        expected = lambda **group: self.last_step_expected_bytes(**group) or self.expected_step_bytes(**group)
        whole_matrices = whole_matrix_step_bytes(self._sharded_param, optimizers)  # the optimizers' own
        sharded = [p for unit in self._units for p in unit.params]
        return {
            "world_size": self._comms[3].world_size,
            "shard_size": self._comms[0].world_size,
            "param_dtype": str(self._units[-1].param_dtype).removeprefix("torch."),
            "reduce_dtype": str(self._units[-1].reduce_dtype).removeprefix("torch."),
            "full_parameters": sum(p.numel for p in sharded) + sum(p.numel() for p in self._persistent),
            "units": len([u for u in self._units if u.params]),
            "last_step": measured(self.shard_group),
            "expected_step_bytes": {**expected(), **({"all_to_all": whole_matrices} if whole_matrices else {})},
            "last_step_across_groups": measured(self.across_groups),
            "expected_step_bytes_across_groups": expected(across_groups=True),
            # reshard_after_forward=G: the backward's All-Gathers inside the groups of G.
            "last_step_in_slice_groups": measured(self.slice_groups),
            "expected_step_bytes_in_slice_groups": expected(slices=True),
            "last_step_control": measured(self.control),
            "gather_wait_s": self.shard_group.last_step_gather_wait_s,
            "units_alive": self.units.alive,
            "peak_units_alive": self.units.peak,
            "peak_units_alive_without_root": self.units.peak_without_root,
            "buffer_bytes": self._pool.bytes(),  # pooled, taken, peak (buffers.py)
            "model_state_bytes": self.model_state_bytes(optimizers),
        }
