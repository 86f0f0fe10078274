"""pytest fixtures: one pool of worker processes per (backend, world size), reused by every test.

A pool's ranks are forked from a fork server that imported torch once (a fraction of a second
per pool after the first), and forming their process group still takes a moment, so the suite
keeps one pool per world size, not one per test. A pool that lost a rank (a worker error kills
it) is replaced on next use; a pool that could not start is not tried again (`helpers.Pools`).
"""
import pytest

from tensor_parallel_toy.tests.helpers import Pools


@pytest.fixture(scope="session")
def pools():
    live = Pools()
    yield live.get
    live.close()
