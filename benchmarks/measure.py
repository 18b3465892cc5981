"""What a rank measures: step times, collective bytes at the torch.distributed API, model-state
bytes, peak RSS. Everything here runs inside a rank process and returns plain data."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Ring factor of each collective: what one rank sends is factor * (N-1)/N * payload.
_RING = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "broadcast": 1.0}
# torch.distributed functions that FSDP2, DeepSpeed and the ZeRO-3 engine call, the kind of
# collective each is, and the argument that holds the payload (the full tensor, or list of
# tensors, that the collective produces or consumes).
_WATCHED: dict[str, tuple[str, str]] = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"),
    "isend": ("send", "tensor"),
    "irecv": ("recv", "tensor"),
}


class DistCounter:
    """Counts calls and bytes of the collectives called through `torch.distributed.<name>`: FSDP2,
    DeepSpeed and the ZeRO-3 engine, not DDP's C++ reducer (its figures are the formula). The names
    are replaced in `torch.distributed` and `distributed_c10d` (DeepSpeed reaches some through it),
    before DeepSpeed's `init_distributed` keeps the functions it finds; in a rank process only."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "payload_bytes": 0})
        self._originals: dict[str, Any] = {}
        self._inside = False  # within a counted call: a collective it makes itself is not counted again

    def install(self) -> None:
        for name, (kind, argument) in _WATCHED.items():
            original = getattr(dist, name, None)
            if original is None:  # e.g. the *_single names, which older torch releases lack
                continue
            self._originals[name] = original
            wrapped = self._wrap(original, kind, argument)
            setattr(dist, name, wrapped)
            if getattr(c10d, name, None) is original:
                setattr(c10d, name, wrapped)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
            if hasattr(c10d, name):
                setattr(c10d, name, original)
        self._originals.clear()

    def _wrap(self, original: Callable, kind: str, argument: str) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # e.g. torch's deprecated reduce_scatter_tensor calls reduce_scatter_single
                return original(*args, **kwargs)
            payload = signature.bind(*args, **kwargs).arguments[argument]  # a tensor or a list of them
            entry = self.counts[kind]
            entry["calls"] += 1
            entry["payload_bytes"] += sum(t.numel() * t.element_size() for t in (
                payload if isinstance(payload, (list, tuple)) else [payload]))  # fmt: skip
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        return counted

    def take(self, world_size: int, *, gloo: bool) -> dict[str, dict[str, Any]]:
        """The counts since the last `take`, with wire bytes; resets them. Under gloo a Reduce-Scatter
        is an All-Reduce of the whole input (its wire bytes are the All-Reduce's); lightning_zero3 on
        gloo gathers by N broadcasts, reported as one All-Gather, and reduces by sends, reported as a
        Reduce-Scatter whose payload is a ring's (N/(N-1) x the bytes sent) and wire bytes the bytes sent."""
        n = world_size
        counts = {kind: dict(entry) for kind, entry in self.counts.items()}
        self.counts.clear()
        out: dict[str, dict[str, Any]] = {}
        for kind, entry in counts.items():
            if kind in ("send", "recv"):
                continue
            factor = 2.0 if kind == "reduce_scatter" and gloo else _RING[kind]
            out[kind] = {**entry, "wire_bytes": int(round(factor * (n - 1) / n * entry["payload_bytes"]))}
        if gloo and "broadcast" in out and "all_gather" not in out and n > 1:
            entry = out.pop("broadcast")
            out["all_gather"] = {**entry, "calls": entry["calls"] // n, "via": "broadcast"}
        sent = counts.get("send")
        if sent and n > 1:
            out["reduce_scatter"] = {
                "calls": sent["calls"] // (n - 1),
                "payload_bytes": sent["payload_bytes"] * n // (n - 1),
                "wire_bytes": sent["payload_bytes"],
                "via": "send/recv",
            }
        return out


def ddp_step_bytes(psi: int, bytes_per_element: int, world_size: int) -> dict[str, dict[str, int]]:
    """DDP's traffic per step (its C++ reducer is invisible to `DistCounter`): Ψ gradients all-reduced once."""
    payload, ring = psi * bytes_per_element, 2 * (world_size - 1) / world_size  # a ring sends 2(N-1)/N of it
    return {"all_reduce": {"calls": 0, "payload_bytes": payload, "wire_bytes": round(ring * payload)}}


def _nbytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor -> this rank's shard
    return t.numel() * t.element_size()


def model_state_bytes(params: Iterable[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes this rank holds of parameters, their gradients and the optimizer state tensors
    (0-d step counters left out), as the ZeRO-3 engine's `model_state_bytes` counts them."""
    params = list(dict.fromkeys(params))
    param_bytes = sum(_nbytes(p) for p in params)
    grad_bytes = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    mine = {id(p) for p in params}
    optim_bytes = 0
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            if id(param) in mine:
                optim_bytes += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"param": param_bytes, "grad": grad_bytes, "optimizer": optim_bytes,
            "total": param_bytes + grad_bytes + optim_bytes}  # fmt: skip


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, RssFile, ...) in bytes; 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> int:
    """Restart the kernel's peak-RSS mark (VmHWM) at the current RSS (Linux >= 4.0), so that a peak
    is this process's own, not the forkserver's it was forked from; the current RSS in bytes."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    return status_bytes("VmHWM")


class StepRecorder:
    """Times steps (device-synchronised) and collects per-step figures."""

    def __init__(self, world_size: int, device: torch.device, counter: DistCounter) -> None:
        self.world_size, self.device, self.counter = world_size, device, counter
        self._gloo = device.type == "cpu"  # the benchmark runs CPU ranks on gloo, GPUs on NCCL
        self.steps: list[dict[str, Any]] = []
        self._t0 = self._cpu0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self.counter.take(self.world_size, gloo=self._gloo)
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def stop(self, loss: torch.Tensor, gather_wait_s: Callable[[], float] | None = None) -> None:
        value = float(loss.detach().item())
        self._sync()
        step: dict[str, Any] = {
            "time_s": time.perf_counter() - self._t0,
            # CPU seconds of this process, all threads (gloo's too): nearly blind to other processes.
            "cpu_s": time.process_time() - self._cpu0,
            "loss": value,
            "comm": self.counter.take(self.world_size, gloo=self._gloo),
            "peak_rss_bytes": peak_rss_bytes(),  # the process's high-water mark so far
        }
        if gather_wait_s is not None:
            step["gather_wait_s"] = gather_wait_s()
        self.steps.append(step)
