"""Emptying and refilling the storage of whole parameters that autograd keeps from forward to
backward (unit.py, Note: whole-parameter blocks): the block's memory moves to the pool and back
(`UntypedStorage._swap_data_ptr_`). The whole weights must be released after forward, where
autograd keeps them, wait in the pool for the next gather, and train exactly like one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel
from tests.support.models import MLP, mlp_batch
from tests.support.parity import local_slice, max_param_difference
from tests.support.ranks import run_ranks


def _saved_bytes(saved: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the tensors autograd saved (empty ones count 0)."""
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in saved}.values())


def _train(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    reference = MLP(dim=64)
    torch.manual_seed(0)
    model = MLP(dim=64)
    sharded = ShardedModel(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    block_bytes = sum(u.block_numel * 4 for u in sharded._units[1:])  # the blocks' whole weights
    block_numels = {u.block_numel for u in sharded._units}
    kept, pooled = [], []
    saved: list[torch.Tensor] = []

    def count_pooled(*_: object) -> None:
        # Registered after the engine's hooks: blocks.0 has just been released. Full-parameter
        # blocks waiting in the pool (its free lists of whole buffers, by role and size class).
        pooled.append(sum(b.numel() in block_numels for free in sharded._pool._free.values() for b, _ in free))

    model.blocks[0].register_forward_hook(count_pooled)
    for step in range(3):
        x, y = mlp_batch(step)
        F.mse_loss(reference(x), y).backward()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        kept.append(_saved_bytes(saved))
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return {
        "param_diff": max_param_difference(sharded, reference),
        "kept": kept,
        "pooled": pooled,
        "block_bytes": block_bytes,
        "last_block_bytes": sharded._units[-1].block_numel * 4,
    }


def test_full_weights_are_released_after_forward_into_the_pool_and_train_exactly():
    for result in run_ranks(_train, 2):
        assert result["param_diff"] < 1e-5
        # After forward autograd keeps activations (a few KiB) and the last block's whole weights,
        # kept for backward (hooks.py, Note: kept for backward), not the other blocks'.
        last = result["last_block_bytes"]
        assert max(result["kept"]) < last + (result["block_bytes"] - last) // 2, result
        assert min(result["pooled"]) >= 1, result  # a released block waits in the pool for the next gather


def _roles_per_buffer(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = MLP(dim=64)
    sharded = ShardedModel(model, prefetch=1, reductions_in_flight=1)
    pool = sharded._pool
    take = type(pool).take
    roles: dict[int, set[str]] = {}
    sizes: dict[str, set[tuple[int, torch.dtype]]] = {}

    def spy(self, role, numel, dtype, device):  # noqa: ANN001, ANN202 - a spy on BufferPool.take
        buffer = take(self, role, numel, dtype, device)
        roles.setdefault(buffer.untyped_storage().data_ptr(), set()).add(role)
        sizes.setdefault(role, set()).add((numel, dtype))
        return buffer

    pool.take = spy.__get__(pool)  # type: ignore[method-assign]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = mlp_batch(step)
        F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"roles": [sorted(r) for r in roles.values()], "sizes": sizes}


def test_a_pooled_buffer_serves_one_role_even_where_sizes_coincide():
    """Gather receive buffers, full-parameter blocks and Reduce-Scatter inputs are taken and
    given back on different streams on CUDA (engine/buffers.py, Note: buffer roles and streams).
    In fp32 a unit's gather and Reduce-Scatter rows have the same size: keyed by size alone, the
    pool handed one role's buffer to the other (issue 22, item 6)."""
    for result in run_ranks(_roles_per_buffer, 2):
        assert result["sizes"]["gather"] & result["sizes"]["reduce"], "the sizes no longer coincide"
        assert all(len(roles) == 1 for roles in result["roles"]), result["roles"]
