"""A model whole in host memory (built there, or made whole by `restore_module`, as a new engine
does with a module at rest after `fit`) is sharded from there: its whole parameters reach the
device one module at a time, never as a whole model (engine/materialize.py, Note: sharding from
host memory). On CPU, "meta" stands in for the accelerator in the engine test; the strategy test
can only see which tensors the strategy asks to move, not device memory. The strategy test stays
on the run_ranks harness: it needs `fit` then `validate` on one Trainer in one process (the second
setup resumes the run at rest), which the launcher starts as two fresh sets of ranks."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_zero3 import ZeRO3Strategy
from lightning_zero3.engine import ShardedModel
from tests.support import lit
from tests.support.ranks import run_ranks


class _WholeOnMeta(TorchFunctionMode):
    """Peak elements of whole parameters on the meta device: copies moved there that are still
    alive, plus parameters registered on the model there with their whole size (not shards)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        named = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()]
        self.whole = [(m, name, p.numel()) for m, name, p in named if p is not None]
        self.alive: dict[int, int] = {}
        self.peak = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.to and out.is_meta and not args[0].is_meta:
            key = id(out)
            self.alive[key] = out.numel()
            weakref.finalize(out, self.alive.pop, key, None)
            registered = [(m._parameters[name], numel) for m, name, numel in self.whole]
            moved = sum(numel for p, numel in registered if p is not None and p.is_meta and p.numel() == numel)
            self.peak = max(self.peak, sum(self.alive.values()) + moved)
        return out


def _layers() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(6)))


def _shard_onto_meta(rank: int, world_size: int) -> dict:
    model = _layers()  # whole, in host memory
    whole = sum(p.numel() for p in model.parameters())
    module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    with _WholeOnMeta(model) as copies:
        ShardedModel(model, device="meta", sync_module_states=False)
    return {
        "peak": copies.peak,
        "module": module,
        "whole": whole,
        "devices": {t.device.type for t in [*model.parameters(), *model.buffers()]},
    }


def test_sharding_from_host_memory_moves_one_module_at_a_time_and_leaves_shards_on_the_device():
    for result in run_ranks(_shard_onto_meta, 2):
        assert result["devices"] == {"meta"}, result
        assert 0 < result["peak"] <= result["module"] < result["whole"] / 6, result


def _second_setup_moves(rank: int, world_size: int) -> list[tuple[int, ...]]:
    lit.become_lightning_rank(rank, world_size)
    model = lit.LitMLP()
    trainer = lit.trainer(ZeRO3Strategy(), world_size, max_steps=1, limit_val_batches=1)
    trainer.fit(model, lit.loader(world_size))  # the module stays sharded, at rest
    moved: list[tuple[int, ...]] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.Tensor.to and isinstance(args[0], nn.Parameter):
                moved.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    strategy = trainer.strategy
    setup = strategy.setup

    def recorded_setup(trainer: Any) -> None:
        with Record():
            setup(trainer)

    strategy.setup = recorded_setup  # the second setup only: it resumes the run at rest
    trainer.validate(model, lit.loader(world_size), verbose=False)
    return moved


def test_a_second_setup_moves_no_whole_parameter_to_the_device():
    for moved in run_ranks(_second_setup_moves, 2):
        assert moved, "the check saw no parameter move at all"
        assert [shape for shape in moved if len(shape) > 1] == [], moved  # shards are 1-D; whole weights not


def _whole_tensors_after_a_step(rank: int, world_size: int, model: nn.Module) -> dict[str, Any]:
    shared_on_arrival = all(t.is_shared() for t in [*model.parameters(), *model.buffers()])
    ShardedModel(model, persistence_threshold=10**6)  # every parameter stays whole
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(rank)  # each rank its own batch: the running statistics differ by rank
    model(torch.randn(8, 4)).square().sum().backward()
    optimizer.step()
    torch.distributed.barrier()  # both ranks have stepped before either reads
    return {"shared_on_arrival": shared_on_arrival, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def test_whole_tensors_a_forkserver_start_left_in_shared_memory_become_each_ranks_own():
    """Engine Note: memory shared by ranks. Passed to the ranks as a forkserver launcher passes it,
    the model's CPU tensors arrive in one shared memory; the persistent parameters and the
    BatchNorm statistics each rank updates must be its own (else the step lands twice, and the
    statistics mix the ranks' batches)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    reference = {}
    for rank in range(2):  # one process: the gradients are averaged, the statistics are each rank's
        twin = copy.deepcopy(model)
        torch.manual_seed(rank)
        twin(torch.randn(8, 4)).square().sum().backward()
        reference[rank] = twin
    grads = [dict((n, p.grad) for n, p in twin.named_parameters()) for twin in reference.values()]
    averaged = {n: (grads[0][n] + grads[1][n]) / 2 for n in grads[0]}
    for rank, result in enumerate(run_ranks(_whole_tensors_after_a_step, 2, model)):
        assert result["shared_on_arrival"], "the ranks did not receive the model in shared memory"
        expected = {n: p.detach() - 0.5 * averaged[n] for n, p in model.named_parameters()}
        expected |= {n: b for n, b in reference[rank].named_buffers()}
        for name, tensor in result["state"].items():
            torch.testing.assert_close(tensor, expected[name], msg=f"rank {rank}: {name}")
