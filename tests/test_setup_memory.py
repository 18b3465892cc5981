"""Setup of a model built with its parameters on the meta device (`configure_model`,
`trainer.init_module(empty_init=True)`) grows each rank's resident memory by its shards plus a
few transient layers, with glibc's default allocator settings, as users run it
(engine/materialize.py, Note: shards before full tensors)."""

from __future__ import annotations

from torch import nn

from lightning_zero3.engine import ShardedModel
from lightning_zero3.engine.materialize import parameters_on_meta
from tests.ranks import run_ranks

MB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _setup_growth(rank: int, world_size: int) -> dict:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) becomes the current resident set (VmRSS)
    start = _status("VmRSS")
    with parameters_on_meta("cpu"):  # what the strategy's configure_model context does
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(24)])  # 384 MiB, 16 MiB per layer
    sharded = ShardedModel(model, device="cpu")
    return {
        "peak": _status("VmHWM") - start,
        "model": sum(p.numel * 4 for p in sharded.sharded_params),
        "unit": max(u.numel * 4 for u in sharded.units),
        "sharded": all(p.dim() == 1 and not p.is_meta for p in model.parameters()),
    }


def test_setup_from_meta_grows_by_the_shards_and_two_layers_not_the_model() -> None:
    for result in run_ranks(_setup_growth, 2):
        assert result["sharded"]
        bound = result["model"] / 2 + 2 * result["unit"] + 100 * MB
        figures = {k: round(v / MB, 1) for k, v in result.items() if k != "sharded"}
        assert result["peak"] <= bound, f"{figures}, bound {bound / MB:.0f} MiB"
