"""pytest fixtures: one pool of worker processes per (backend, world size), reused by every test,
and the commands that run in the background from the session's start.

A pool's ranks are forked from a fork server that imported torch once (a fraction of a second
per pool after the first), and forming their process group still takes a moment, so the suite
keeps one pool per world size, not one per test. A pool that lost a rank (a worker error kills
it) is replaced on next use; a pool that could not start is not tried again (`processes.Pools`).

A test marked `@pytest.mark.background(name, ...)` runs whole commands as a reader would (a
fresh Python, its own ranks): each command, `BACKGROUND[name](folder)` in the test's module,
is queued with the session and runs beside the other tests, two at a time in the tests' order
(or at once when its test asks for it), and the test reads its result from the `background`
fixture (`processes.Background`).
"""
import functools
import os

import pytest

from tensor_parallel_toy.launcher.pool import WorkerPool
from tensor_parallel_toy.launcher.rank_output import RANK_LOGS_ENV
from tensor_parallel_toy.tests.processes import Background, Pools


def pytest_configure(config):
    config.addinivalue_line("markers", "background(*names): the test's commands, BACKGROUND[name] "
                                       "of its module, start with the session")


@pytest.fixture(scope="session")
def pools(tmp_path_factory):
    # The ranks' own stderr goes to files (gpu-check's step folder, else the session's temporary
    # one), so a rank's error reaches the test's failure message whatever pytest captures.
    logs = os.environ.get(RANK_LOGS_ENV) or str(tmp_path_factory.mktemp("ranks"))
    live = Pools(start=functools.partial(WorkerPool, log_dir=logs))
    yield live.get
    live.close()


@pytest.fixture(scope="session", autouse=True)
def background(request, tmp_path_factory):
    runs = Background(str(tmp_path_factory.mktemp("background")))
    for item in request.session.items:
        marker = item.get_closest_marker("background")
        for name in marker.args if marker is not None else ():
            runs.start(name, **item.module.BACKGROUND[name](runs.folder))
    yield runs
    runs.close()
