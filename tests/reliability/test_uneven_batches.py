"""A rank given more training batches than its peers fails fast on every rank with an error that
names uneven batch counts and the fix, never a timeout or an abort (engine/checks.py, Note:
uneven batches). Lightning's real Trainer, a DataLoader without a DistributedSampler. On the gloo
harness's ranks (tests/support/ranks.py), not the launcher's: it reads the error and its time on every
rank, and Lightning's launcher re-raises only the first failed rank's and terminates the others."""

from __future__ import annotations

import time

import pytest
from torch.utils.data import DataLoader, TensorDataset

from tests.support.lit import LitMLP, become_lightning_rank, dataset, trainer
from tests.support.ranks import run_ranks

TIMEOUT_S = 40  # the process group's: a hang fails the test with another message


def _fit_with_batches(
    rank: int, world_size: int, batches: list[int], max_steps: int = -1, accumulate: int = 1, unsharded: bool = False
) -> tuple[str, float]:
    become_lightning_rank(rank, world_size)
    from lightning_zero3 import ZeRO3Strategy

    x, y = dataset().tensors
    n = 6 * batches[rank]
    data = DataLoader(TensorDataset(x[:n], y[:n]), batch_size=6)
    t = trainer(
        ZeRO3Strategy(accumulate_unsharded=unsharded), world_size, max_epochs=2, max_steps=max_steps,
        use_distributed_sampler=False, accumulate_grad_batches=accumulate,
    )  # fmt: skip
    start = time.monotonic()
    try:
        t.fit(LitMLP(), data)
    except Exception as err:  # noqa: BLE001 - every rank's message goes back to the test
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return "finished", time.monotonic() - start


@pytest.mark.parametrize("batches", [[3, 2], [2, 3]], ids=["rank0_ahead", "rank1_ahead"])
def test_uneven_batch_counts_fail_fast_on_every_rank_naming_the_cause(batches: list[int]) -> None:
    for message, seconds in run_ranks(_fit_with_batches, 2, batches, timeout_s=TIMEOUT_S):
        assert "Uneven batch counts" in message and "use_distributed_sampler" in message, message
        assert seconds < TIMEOUT_S / 2  # not the process group's timeout


def test_uneven_loaders_train_when_max_steps_ends_the_run_on_every_rank_first() -> None:
    results = run_ranks(_fit_with_batches, 2, [3, 2], 2, timeout_s=TIMEOUT_S)
    assert [message for message, _ in results] == ["finished"] * 2


def test_uneven_batch_counts_with_accumulation_fail_fast_when_a_short_epoch_flush_ends_the_run() -> None:
    """3 and 4 batches, 2 per optimizer step, max_steps=2: rank 0's second step flushes its short
    epoch at its 3rd batch, rank 1's comes at its 4th. That step is not one every rank reaches alike."""
    for message, seconds in run_ranks(_fit_with_batches, 2, [3, 4], 2, 2, timeout_s=TIMEOUT_S):
        assert "Uneven batch counts" in message, message
        assert seconds < TIMEOUT_S / 2


def test_uneven_batch_counts_with_unsynced_accumulation_fail_fast() -> None:
    """3 and 4 batches, 2 per optimizer step, `accumulate_unsharded=True`: rank 0's 3rd batch
    flushes (syncs), rank 1's begins an unsynced step; the unsynced backward reads the tags first."""
    for message, seconds in run_ranks(_fit_with_batches, 2, [3, 4], -1, 2, True, timeout_s=TIMEOUT_S):
        assert "Uneven batch counts" in message, message
        assert seconds < TIMEOUT_S / 2
