"""`SharedArena`: All-Gathers and Reduce-Scatters of CPU tensors through one shared-memory file,
for the ranks of a process group that all run on one host. Part of comm.py, which owns it,
chooses it per collective and hands it its two ways to reach the other ranks (comm.py is the
only module that calls torch.distributed): a small gloo All-Reduce and `all_gather_object`.

[Note: shared-memory transport]
On gloo a collective's bytes go through loopback TCP: the kernel copies them into socket
buffers and out again, in gloo's threads, as CPU time the step pays for (docs/performance.md).
Ranks on one host can instead map one file in /dev/shm and copy straight into and out of it:
- All-Gather: each rank copies its row into its slot, then one barrier, then each rank copies
  the other ranks' rows out of their slots into its output.
- Reduce-Scatter: each rank copies row j of its full (N, chunk) input into its region's row j
  for every other rank j, then one barrier, then each rank sums row r (its own) over ranks in
  rank order, its own input's row read in place: the same additions in the same order as the
  send/recv path (comm.py, Note: gloo), so the result is bitwise the same.
The barrier is a gloo All-Reduce (maximum) of four int64: the collective's sequence number, a
code of its kind and size, and both negated. Each rank gets back the largest and the smallest
of each over the ranks, so all of them see alike whether every rank is at this same collective;
if not, every rank raises, instead of reading a slot the others have not written, or rows a
collective two before left there (whose unit tags would pass the checks). A sum would not do:
it can match by chance (sequence numbers 2, 3, 4 sum as three 3s), and the rank it matches for
would go on alone and hang at its next collective.

Double buffering: the file holds two slot sets; collective k uses set k % 2. A rank writes set
s at collective k only after its barrier of collective k - 1 returned, which happens only once
every rank has reached that barrier, i.e. has finished reading collective k - 2, the last one
that used set s. Writes of collective k happen before each writer reaches barrier k, reads after
it returns. So one barrier per collective suffices, provided each collective has finished
reading before the rank starts the next one: the transport is synchronous (issue = complete;
the engine's `wait` finds nothing to wait for). Handing out views into a slot instead of
copying out would let a reader still be reading set s while a faster rank, two collectives on,
overwrites it; that would need a second barrier.

The file: rank 0 creates it (exclusive, mode 0600), reserves its size with `posix_fallocate`
(so a /dev/shm too small fails here with ENOSPC, not with SIGBUS at a later write), every rank
maps it, and rank 0 unlinks it as soon as every rank has mapped it (or failed to): the memory
lives on only as long as some rank's mapping, so no file outlives the ranks, except if rank 0
is killed in the milliseconds between creating and unlinking (the name says which process:
`lightning_zero3-<pid>-<random>`).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any, cast

import torch

__all__ = ["CPU_TRANSPORTS", "SharedArena", "SharedMemoryError", "host_identity", "validate_cpu_transport"]

# How CPU tensors' All-Gathers and Reduce-Scatters travel: through the process group (gloo), or
# through a shared-memory file when every rank of the group is on one host.
CPU_TRANSPORTS = ("process_group", "shared_memory")

# Bytes each slot set starts at a multiple of (a cache line; every dtype's size divides it).
_ALIGN = 64


class SharedMemoryError(RuntimeError):
    """The shared-memory transport cannot be set up (ranks on several hosts, /dev/shm too small)."""


def host_identity() -> str:
    """What two processes on one host (and one kernel boot) have in common."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def validate_cpu_transport(value: object, *, owner: str | None = None) -> None:
    """`ValueError` unless `value` is one of CPU_TRANSPORTS."""
    if value not in CPU_TRANSPORTS:
        where = f"{owner}(cpu_transport=...)" if owner is not None else "cpu_transport"
        raise ValueError(
            f"{where} must be one of {CPU_TRANSPORTS} ('shared_memory': ranks on one host only); got {value!r}."
        )


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class SharedArena:
    """Two slot sets of `set_bytes` each in one shared file, mapped by every rank of a group.
    Building it is collective: every rank of the group must call it. `exchange` gathers one
    picklable object per rank (Comm.all_gather_object); `all_reduce_max` takes the element-wise
    maximum of a CPU int64 tensor over the group, in place (the barrier)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        set_bytes: int,
        exchange: Callable[[Any], list[Any]],
        all_reduce_max: Callable[[torch.Tensor], None],
        directory: str = "/dev/shm",
    ) -> None:
        self._all_reduce_max = all_reduce_max
        self.rank = rank
        self.world_size = world_size
        self.set_bytes = _aligned(set_bytes)
        # Collectives done so far; collective k uses set k % 2 (Note: shared-memory transport).
        self.sequence = 0
        # The barrier's integers, reused: sequence, -sequence, code, -code (Note: shared-memory transport).
        self._flag = torch.zeros(4, dtype=torch.int64)
        hosts = exchange(host_identity())
        if len(set(hosts)) > 1:
            where = ", ".join(f"rank {r}: {h.split('/')[0]}" for r, h in enumerate(hosts))
            raise SharedMemoryError(
                f"The shared-memory transport needs every rank of the process group on one host, but they "
                f"run on several [{where}]. Use cpu_transport='process_group' for ranks on several hosts "
                f"(or shard_size = the processes per node, so that each shard group is on one host)."
            )
        self.storage = self._map(directory, 2 * self.set_bytes, exchange)

    def _map(self, directory: str, nbytes: int, exchange: Callable[[Any], list[Any]]) -> torch.UntypedStorage:
        created, problem = _create(directory, nbytes) if self.rank == 0 else (None, None)
        storage, problems = None, []
        try:
            path = exchange((created, problem))[0][0]
            mine = None
            if path is not None:
                try:
                    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
                except RuntimeError as err:
                    mine = f"rank {self.rank} could not map {path}: {err}"
            problems = [p for p in exchange(problem or mine) if p]
        finally:
            # Every rank has mapped it or failed to, or an exchange raised (a rank left): the name
            # is no longer needed either way.
            if created is not None:
                os.unlink(created)
        if problems or storage is None:
            raise SharedMemoryError(
                f"The shared-memory transport could not be set up: {'; '.join(problems)}. Free space in "
                f"{directory} (e.g. a larger --shm-size for a container), or use cpu_transport='process_group'."
            )
        return cast(torch.UntypedStorage, storage)

    def fits(self, nbytes: int) -> bool:
        """Whether a collective of `nbytes` (the larger of what it writes and reads) fits a slot set."""
        return nbytes <= self.set_bytes

    def _slots(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot set of the collective in progress, as a `dtype` tensor of `shape`."""
        offset = (self.sequence % 2) * self.set_bytes
        numel = 1
        for s in shape:
            numel *= s
        assert numel * dtype.itemsize <= self.set_bytes, "caller must check fits()"
        view = torch.empty(0, dtype=dtype)
        return view.set_(self.storage, offset // dtype.itemsize, shape)  # type: ignore[call-overload]

    def _barrier(self, kind: str, nbytes: int) -> None:
        """Every rank has written its part of this collective, and every rank is at this same
        collective (`kind` of `nbytes`), or every rank raises; see the Note for why one suffices."""
        sequence, code = self.sequence, 2 * nbytes + (kind == "Reduce-Scatter")
        flag = self._flag
        flag[0], flag[1], flag[2], flag[3] = sequence, -sequence, code, -code
        self._all_reduce_max(flag)
        high, minus_low, high_code, minus_low_code = flag.tolist()
        low, low_code = -minus_low, -minus_low_code
        if (high, low, high_code, low_code) != (sequence, sequence, code, code):
            raise RuntimeError(
                f"shared-memory collective {sequence} ({kind} of {nbytes:,} bytes) met a rank at another "
                f"collective: the ranks are at shared-memory collectives {low} to {high}, of {low_code // 2:,} to "
                f"{high_code // 2:,} bytes. They ran different collectives at this point (e.g. different units, "
                f"data-dependent control flow); every rank raises this"
            )

    def all_gather(self, rows: torch.Tensor, own: torch.Tensor, *, fill_own_row: bool) -> None:
        """`rows` (N, w) gets every rank's `own` (w,) row; its own row only with `fill_own_row`."""
        n, me = self.world_size, self.rank
        slots = self._slots(rows.dtype, (n, rows.shape[1]))
        slots[me].copy_(own)
        self._barrier("All-Gather", slots.numel() * slots.element_size())
        for r in range(n):
            if r != me or (fill_own_row and own.data_ptr() != rows[me].data_ptr()):
                rows[r].copy_(slots[r])
        self.sequence += 1

    def reduce_scatter(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """`out` (chunk,) = sum over ranks of their `rows[me]` ((N, chunk) each), in rank order."""
        n, me = self.world_size, self.rank
        chunk = rows.shape[1]
        regions = self._slots(rows.dtype, (n, n, chunk))  # regions[writer][reader]
        for r in range(n):
            if r != me:
                regions[me, r].copy_(rows[r])
        self._barrier("Reduce-Scatter", regions.numel() * regions.element_size())
        parts = [rows[me] if r == me else regions[r, me] for r in range(n)]
        torch.add(parts[0], parts[1], out=out)  # rank order, as the send/recv path (comm.py, Note: gloo)
        for part in parts[2:]:
            out.add_(part)
        self.sequence += 1


def _create(directory: str, nbytes: int) -> tuple[str | None, str | None]:
    """Create and reserve the file on rank 0: (path, None), or (None, what went wrong)."""
    try:
        free = os.statvfs(directory)
    except OSError as err:
        return None, f"{directory} is not usable: {err}"
    if free.f_bavail * free.f_frsize < nbytes:
        return None, (
            f"{directory} has {free.f_bavail * free.f_frsize:,} bytes free, the transport needs {nbytes:,} "
            f"(two slot sets of the largest unit's collective)"
        )
    path = os.path.join(directory, f"lightning_zero3-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as err:
        return None, f"could not create {path}: {err}"
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserves the pages: ENOSPC now rather than SIGBUS later
    except OSError as err:
        os.unlink(path)
        return None, f"could not reserve {nbytes:,} bytes in {directory}: {err}"
    finally:
        os.close(fd)
    return path, None
