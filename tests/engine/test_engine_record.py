"""The step record (engine/record.py) is the one source of truth of what a step gathered, kept
and reduced; the byte formula (engine/accounting.py) is the oracle it is checked against, and
the bytes each collective measured (engine/comm.py) must be what the record says was moved."""

from __future__ import annotations

import pytest
import torch

from lightning_zero3.engine import ShardedModel, accounting
from tests.support.models import MLP, TinyGPT, gpt_batch, mlp_batch, mlp_frozen_block
from tests.support.parity import lm_loss, local_slice
from tests.support.ranks import run_ranks

MODELS = {
    "mlp": (MLP, mlp_batch, torch.nn.functional.mse_loss),
    "tiny_gpt": (TinyGPT, gpt_batch, lm_loss),
    "mlp_frozen_block": (mlp_frozen_block, mlp_batch, torch.nn.functional.mse_loss),
}


def _steps(rank: int, world_size: int, model_name: str, prefetch: int, reshard: bool | int = True) -> list[dict]:
    factory, batch, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = factory()
    sharded = ShardedModel(model, prefetch=prefetch, persistence_threshold=16, reshard_after_forward=reshard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    units = sharded._units
    out = []
    for step in range(3):
        x, y = batch(step)
        loss_fn(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
        sharded.stats.end_step()
        record = sharded.stats.last_step_record
        assert record is not None
        row = {u.uid: world_size * u.row_numel() * u.param_dtype.itemsize for u in units}
        g = sharded._slice_comm.world_size if sharded._slice_comm is not None else 1
        slice_row = {u.uid: g * u.row_numel(per=world_size // g) * u.param_dtype.itemsize for u in units}
        reduce_row = {u.uid: world_size * u.reduce_row_numel * u.reduce_dtype.itemsize for u in units}
        # The formula's gathers per unit: (over the shard group, inside the groups of G).
        sizes = {uid: size for uid, size in accounting.unit_sizes(units, record.orders).items() if units[uid].params}
        oracle = {uid: accounting.gathers(size, reshard) for uid, size in sizes.items()}
        out.append({
            "gathered": dict(record.gathered),
            "kept": set(record.kept),
            "reduced": dict(record.reduced),
            "oracle_gathered": {uid: k for uid, (k, _) in oracle.items()},
            "oracle_kept": {uid for uid, size in sizes.items() if accounting.keeps_whole(size, reshard)},
            "gathered_slice": dict(record.gathered_slice),
            "kept_slice": dict(record.kept_slice),
            "oracle_slices": {uid: k for uid, (_, k) in oracle.items() if k},
            "trainable": {u.uid for u in units if any(p.requires_grad for p in u.params)},
            "record_bytes": {
                "all_gather": sum(row[uid] * k for uid, k in record.gathered.items()),
                "reduce_scatter": sum(reduce_row[uid] * k for uid, k in record.reduced.items()),
                "slices": sum(slice_row[uid] * k for uid, k in record.gathered_slice.items()),
            },
            "measured": {kind: b.payload_bytes for kind, b in sharded.stats.shard_group.last_step.items()},
            "measured_slices": sum(b.payload_bytes for b in sharded.stats.slice_groups.last_step.values())
            if sharded.stats.slice_groups is not None else 0,
            "formula": sharded.stats.last_step_expected_bytes(),
            "formula_slices": sharded.stats.last_step_expected_bytes(slices=True),
        })  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("model_name", "prefetch", "reshard", "world_size"),
    [("mlp", 1, True, 2), ("tiny_gpt", 2, True, 2), ("mlp_frozen_block", 0, True, 2),
     ("mlp", 1, False, 2), ("mlp_frozen_block", 1, False, 2), ("mlp_frozen_block", 1, 2, 4)],
)  # fmt: skip
def test_the_record_of_every_step_matches_the_formula_and_the_measured_bytes(model_name, prefetch, reshard, world_size):
    """First step (no order recorded: only the root kept) and steady steps (the last unit and
    the units around it kept too): the units gathered once or twice, kept and reduced are what
    accounting.py predicts, and the bytes the collectives counted are the record's units' rows.
    With reshard_after_forward=False every unit with a backward is kept and gathered once; with
    G=2 of 4 ranks the others keep a slice and gather it inside their pair of ranks."""
    for steps in run_ranks(_steps, world_size, model_name, prefetch, reshard):
        if reshard is True:
            assert steps[0]["kept"] != steps[2]["kept"], "the first step keeps fewer units"
        for step in steps:
            assert step["gathered"] == step["oracle_gathered"], step
            assert step["kept"] == step["oracle_kept"], step
            assert step["reduced"] == dict.fromkeys(step["trainable"], 1), step
            assert step["gathered_slice"] == step["kept_slice"] == step["oracle_slices"], step
            assert (len(step["oracle_slices"]) > 0) == (reshard not in (True, False)), step
            for kind in ("all_gather", "reduce_scatter"):
                assert step["measured"][kind] == step["record_bytes"][kind] == step["formula"][kind], step
            slices = step["formula_slices"].get("all_gather", 0)
            assert step["measured_slices"] == step["record_bytes"]["slices"] == slices, step
        if reshard is False:
            assert all(k == 1 for k in steps[2]["gathered"].values()), "no backward All-Gather"
