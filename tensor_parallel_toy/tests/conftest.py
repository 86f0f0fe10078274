"""pytest fixtures: one pool of worker processes per (backend, world size), reused by every test.

Spawning a rank costs seconds (each imports torch), so the suite pays it once per world size,
not once per test. A pool that lost a rank (a worker error kills it) is replaced on next use;
a pool that could not start is not tried again (see `helpers.Pools`).
"""
import pytest

from tensor_parallel_toy.tests.helpers import Pools


@pytest.fixture(scope="session")
def pools():
    live = Pools()
    yield live.get
    live.close()
