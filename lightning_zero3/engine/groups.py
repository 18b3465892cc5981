"""Process groups the engine makes: the hybrid layout's groups, and their end at exit.

[Note: leaving at exit]
A gloo worker thread drops its reference to a collective's work only after the waiter has woken, and
that can be the last reference to a tensor Python made (`all_gather_object`'s, DCP's), whose release
takes the GIL. (docs/design.md, leaving at exit)
"""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist


class _LetsGo(Protocol):
    def release(self) -> None: ...


def consecutive_group(size: int, timeout: timedelta | None) -> dist.ProcessGroup | None:
    """This rank's group of `size` consecutive ranks (collective)."""
    starts = range(0, dist.get_world_size(), size)
    return [new_group(list(range(start, start + size)), timeout=timeout) for start in starts][dist.get_rank() // size]


def hybrid_groups(
    shard_size: int, timeout: timedelta | None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(shard group, replicate group): groups of `shard_size` consecutive ranks shard the model, the ranks
    at one position in each replicate it; (None, None): the whole world shards. Collective."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % shard_size:
        raise ValueError(
            f"shard_size must be a positive int that divides the world size {world} (e.g. the "
            f"processes per node); got {shard_size!r}."
        )
    if shard_size == world:
        return None, None
    shard_group = consecutive_group(shard_size, timeout)
    replicate = [new_group(list(range(offset, world, shard_size)), timeout=timeout) for offset in range(shard_size)]
    return shard_group, replicate[dist.get_rank() % shard_size]


def new_group(
    ranks: list[int] | None = None, *, backend: str | None = None, timeout: timedelta | None = None
) -> dist.ProcessGroup:
    """`dist.new_group`, destroyed at exit at the latest (Note: leaving at exit); timeout=None: torch's 30 min."""
    group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        _MADE.append(group)
    return group


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Destroy `group` if it still exists (no collective)."""
    if group in _MADE:
        _MADE.remove(group)
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError):
        pass  # destroyed already


_LIVE: weakref.WeakSet[_LetsGo] = weakref.WeakSet()  # every Comm over a process group
_MADE: list[dist.ProcessGroup] = []  # the groups new_group made and nobody destroyed yet


def let_go_at_exit(comm: _LetsGo) -> None:
    """`comm.release()` runs at exit, after the groups are destroyed (Note: leaving at exit)."""
    _LIVE.add(comm)


def _leave_at_exit() -> None:
    """Note: leaving at exit."""
    while _MADE:
        destroy_group(_MADE[-1])
    for comm in list(_LIVE):
        comm.release()


atexit.register(_leave_at_exit)
