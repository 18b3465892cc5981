"""Sharded saves that write in a background thread while training goes on.

[Note: background saves]
The caller's thread copies the shards to host memory; a thread writes them on a gloo group of its
own, one save in flight, its outcome agreed on the training group at the next save, load or
teardown, so a background error is raised on every rank (docs/design.md, background saves).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_zero3.checkpoint.errors import describe_error
from lightning_zero3.engine import Comm, new_group

log = logging.getLogger(__name__)


class BackgroundSave:
    """One save's write running in a thread; `wait` joins it and returns its error, or None."""

    def __init__(self, write: Callable[[], None], *, what: str) -> None:
        self.what = what  # named in messages: "the checkpoint PATH"
        self._error: str | None = None
        self._lock = threading.Lock()  # guards _after and _done
        self._after: list[Callable[[], None]] = []  # rank 0's removals, run once the save succeeded
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(write,), name="zero3-checkpoint-save")
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as err:  # noqa: BLE001 - reported at the wait point, on every rank
            self._error = describe_error(err)
            log.error(f"Saving {self.what} in the background failed: {self._error}")  # also if never waited for
        with self._lock:
            self._done = True
            after, self._after = self._after, []
        for fn in after if self._error is None else []:
            _run_logged(fn)

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` (no collective) once this save has succeeded; at once if it already has."""
        with self._lock:
            if not self._done:
                self._after.append(fn)
                return
        if self._error is None:
            _run_logged(fn)

    def wait(self) -> str | None:
        self._thread.join()
        return self._error


def _run_logged(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - a removal that fails leaves a file, never a hang
        log.warning(f"After a background checkpoint save: {describe_error(err)}")


def saver_comm(world: Comm, timeout: timedelta) -> Comm:
    """A gloo group over `world`'s ranks (collective), failing after `timeout` as the world does."""
    if not world.distributed:
        return world
    ranks = dist.get_process_group_ranks(world.group) if world.group is not None else None
    return Comm(new_group(ranks, backend="gloo", timeout=timeout), device=torch.device("cpu"))


__all__ = ["BackgroundSave", "saver_comm"]
