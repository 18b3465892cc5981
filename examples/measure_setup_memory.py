"""Peak memory per rank while a 384 MiB model is built and sharded, and while it is made whole
again at teardown, on 2 CPU ranks (gloo), with glibc's default allocator settings.

    python examples/measure_setup_memory.py        # ~30-60 s on 2 cores

Four ways to get the same sharded model (12 blocks of two 2048x2048 nn.Linear, 384 MiB in
fp32) onto 2 ranks; for each, every rank prints how far its resident memory rose above where it
started (the peak, VmHWM, after resetting it through /proc/self/clear_refs):

- meta:         built with its parameters on the meta device (what `configure_model` and
                `trainer.init_module(empty_init=True)` do with this strategy: `parameters_on_meta`),
                then materialised, initialised, broadcast from rank 0 and sharded one module at a
                time; the bound printed is model / N + 2 units + 100 MiB;
- whole:        built whole on every rank first, as for DDP, then sharded;
- meta + mmap:  meta as above, then pretrained whole weights loaded from a file opened with
                `torch.load(path, mmap=True)`: each rank copies only its slice of each tensor;
- meta + load:  the same file read with a plain `torch.load(path)` (the whole state dict in RAM).

Then, for the meta run, teardown's `restore_module`: whole parameters gathered one unit at a
time into host memory ("cpu": the output, 384 MiB, plus about one unit), and the same towards
another device ("meta" stands in for host memory while the shards are on a GPU: what stays on
the shards' device is about one unit).

Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests.support.ranks

from benchmarks.measure import reset_peak_rss, status_bytes  # noqa: E402
from lightning_zero3.engine import (
    ShardedModel,  # noqa: E402
    parameters_on_meta,  # noqa: E402
)
from tests.support.ranks import run_ranks  # noqa: E402

MB = 2**20


class Wide(nn.Module):
    """12 blocks of two 2048x2048 linears: 32 MiB per block, 384 MiB in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048)) for _ in range(12))


def measure(rank: int, world_size: int, mode: str, path: str, restore_to: str = "cpu") -> dict:
    # No mallopt: glibc's defaults, as users run. (A fixed M_MMAP_THRESHOLD, as earlier versions
    # of this script set, returns every freed 16 MiB tensor to the OS and hides heap fragmentation.)
    torch.manual_seed(rank)  # the ranks' seeds differ: rank 0's initial values are broadcast
    start = reset_peak_rss()
    t0 = time.perf_counter()
    with torch.device("cpu") if mode == "whole" else parameters_on_meta("cpu"):
        model = Wide()
    sharded = ShardedModel(model, device="cpu")
    result = {"setup_peak": status_bytes("VmHWM") - start, "setup_s": time.perf_counter() - t0}
    result["shard_bytes"] = sum(p.param.numel() * p.param.element_size() for p in sharded.sharded_params)
    result["unit_bytes"] = max(u.numel * 4 for u in sharded._units)
    if mode.startswith("meta +"):
        start, file_start = reset_peak_rss(), status_bytes("RssFile")
        t0 = time.perf_counter()
        state_dict = torch.load(path, mmap=mode == "meta + mmap", weights_only=True)
        sharded.load_full_state_dict(state_dict)  # each rank copies its slice of each tensor
        result["load_peak"] = status_bytes("VmHWM") - start
        result["load_file_backed"] = status_bytes("RssFile") - file_start  # pages of the mapped file
        result["load_s"] = time.perf_counter() - t0
        del state_dict
        probe = sharded.sharded_params[0]
        result["loaded_ok"] = bool(torch.equal(probe.param.detach(), _expected_slice(path, probe)))
    if mode == "meta":
        start = reset_peak_rss()
        sharded.restore_module(device=restore_to)
        result["restore_peak"] = status_bytes("VmHWM") - start
    return result


def _expected_slice(path: str, probe: object) -> torch.Tensor:
    from lightning_zero3.engine import shard_slice

    full = torch.load(path, mmap=True, weights_only=True)[probe.name]  # type: ignore[attr-defined]
    return shard_slice(full, probe.rank, probe.world_size)  # type: ignore[attr-defined]


def main() -> None:
    model_bytes = 12 * 2 * (2048 * 2048 + 2048) * 4
    module_bytes = (2048 * 2048 + 2048) * 4  # the largest module materialised at once: one nn.Linear
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pretrained.pt")
        torch.manual_seed(0)
        torch.save(Wide().state_dict(), path)  # stands in for a pretrained checkpoint
        print(f"model: {model_bytes / MB:.1f} MiB in fp32; one nn.Linear {module_bytes / MB:.1f} MiB; N = 2 ranks")
        print(f"per rank: shards {model_bytes / 2 / MB:.1f} MiB (model / N)\n")
        print(f"{'mode':<14}{'rank':>5}{'setup peak MiB':>16}{'setup s':>9}{'load peak MiB':>15}{'of it file':>12}")
        restores = []
        for mode in ("meta", "whole", "meta + mmap", "meta + load"):
            for rank, r in enumerate(run_ranks(measure, 2, mode, path)):
                load = f"{r['load_peak'] / MB:>15.1f}{r['load_file_backed'] / MB:>12.1f}" if "load_peak" in r else ""
                print(f"{mode:<14}{rank:>5}{r['setup_peak'] / MB:>16.1f}{r['setup_s']:>9.2f}{load}")
                assert r.get("loaded_ok", True), "the loaded shard differs from the file's slice"
                if mode == "meta":
                    bound = r["shard_bytes"] + 2 * r["unit_bytes"] + 100 * MB
                    print(f"{'':<14}{'':>5}{'bound ' + format(bound / MB, '.1f'):>16}  (model / N + 2 units + 100 MiB)")
                    restores.append(("cpu", rank, r["restore_peak"]))
        for rank, r in enumerate(run_ranks(measure, 2, "meta", path, "meta")):
            restores.append(("meta", rank, r["restore_peak"]))
        print(f"\nteardown (restore_module, unit {r['unit_bytes'] / MB:.1f} MiB):")
        print(f"{'restore to':<14}{'rank':>5}{'peak MiB':>12}")
        for device, rank, peak in restores:
            print(f"{device:<14}{rank:>5}{peak / MB:>12.1f}")
    print("\nsetup peak: resident memory above the start while building and sharding (shards included).")
    print("load peak: above the sharded model while loading the file; 'of it file': pages of the")
    print("memory-mapped file resident in this process (page cache, shared, reclaimable).")


if __name__ == "__main__":
    main()
