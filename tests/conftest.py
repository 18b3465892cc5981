"""Each test starts from the environment the session started with: Lightning's launcher and
`seed_everything`, run in the test process by the tests that launch as Lightning's suite does
(tests/adapted.py `launched`), write os.environ (PL_GLOBAL_SEED, MASTER_PORT, ...), and every rank
a later test starts would inherit it (PL_GLOBAL_SEED reseeds Lightning's ranks)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
