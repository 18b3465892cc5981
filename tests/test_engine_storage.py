"""The two ways of emptying and refilling the storage of full parameters that autograd keeps
from forward to backward (unit.py, Note: full-parameter blocks): moved to the pool and back
(`UntypedStorage._swap_data_ptr_`, CPU) and freed/allocated with `resize_` (other devices, and
any torch without the private method). Each path must release the full weights after forward,
where autograd keeps them, and train exactly like one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_zero3.engine import ShardedModel, unit
from tests.models import MLP, mlp_batch
from tests.parity import local_slice, max_param_difference
from tests.ranks import run_ranks

PATHS = ["swap", "resize"]


def _saved_bytes(saved: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind the tensors autograd saved (empty ones count 0)."""
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in saved}.values())


def _train(rank: int, world_size: int, path: str) -> dict:
    unit._SWAP_STORAGE = path == "swap"  # what a torch without _swap_data_ptr_ selects
    torch.manual_seed(0)
    reference = MLP(dim=64)
    torch.manual_seed(0)
    model = MLP(dim=64)
    sharded = ShardedModel(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    block_bytes = sum(u.block_numel * 4 for u in sharded.units[1:])  # the blocks' full weights
    block_numels = {u.block_numel for u in sharded.units}
    kept, pooled = [], []
    saved: list[torch.Tensor] = []

    def count_pooled(*_: object) -> None:
        # Registered after the engine's hooks: blocks.0 has just been released. Full-parameter
        # blocks waiting in the pool (its free lists, keyed by numel, dtype, device).
        pooled.append(sum(len(free) for (numel, _, _), free in sharded.pool._free.items() if numel in block_numels))

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
        "last_block_bytes": sharded.units[-1].block_numel * 4,
    }


@pytest.mark.parametrize("path", PATHS)
def test_both_storage_paths_release_full_weights_after_forward_and_train_exactly(path: str):
    if path == "swap" and not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        pytest.skip("this torch has no UntypedStorage._swap_data_ptr_: only the resize_ path exists")
    for result in run_ranks(_train, 2, path):
        assert result["param_diff"] < 1e-5
        # After forward autograd keeps activations (a few KiB) and the last block's full weights,
        # kept for backward (hooks.py, Note: kept for backward), not the other blocks'.
        last = result["last_block_bytes"]
        assert max(result["kept"]) < last + (result["block_bytes"] - last) // 2, result
        # swap: a released block waits in the pool for the next gather; resize: freed.
        assert min(result["pooled"]) >= 1 if path == "swap" else max(result["pooled"]) == 0, result


def test_only_cpu_storages_move_blocks():
    """CUDA's caching allocator already reuses freed blocks: the public resize_ path there."""
    assert unit.moves_blocks(torch.device("cpu")) == hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    assert not unit.moves_blocks(torch.device("cuda", 0))
    assert not unit.moves_blocks(torch.device("meta"))
