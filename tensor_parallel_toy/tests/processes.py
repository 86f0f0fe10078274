"""The processes the tests start: the worker pools they share, and the commands run as a reader
runs them, in the background from the session's start (conftest.py holds the fixtures).
"""
import os
import subprocess
import threading
import time

import pytest

from tensor_parallel_toy.launcher.initialize import SHARE_GPU_ENV, gpu_count, nccl_rank_capacity
from tensor_parallel_toy.launcher.pool import WorkerError, WorkerPool


class Pools:
    """The suite's worker pools, one per (backend, world size), started on first use.

    Once a pool fails to start (NCCL or CUDA cannot come up, or a rank hangs while the group
    forms), every later test that asks for a pool of that backend with as many ranks or more
    fails at once with that first error, instead of starting ranks again and waiting out the
    same timeout: on a machine where NCCL cannot start, one test pays the timeout, not all."""

    def __init__(self, start=WorkerPool):
        self.live, self.failed, self._start = {}, {}, start

    def get(self, world_size, backend="gloo"):
        key = (backend, world_size)
        if key in self.live and self.live[key].alive:
            return self.live[key]
        if backend == "nccl" and nccl_rank_capacity() < world_size:
            pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs, found {gpu_count()}"
                        f" (with {SHARE_GPU_ENV}=1, at most {nccl_rank_capacity()} ranks share "
                        f"one: more were never run)" if nccl_rank_capacity() > gpu_count()
                        else f"{world_size} NCCL ranks need {world_size} GPUs (or "
                             f"{SHARE_GPU_ENV}=1 for 2 on one), found {gpu_count()}")
        first = min((n for b, n in self.failed if b == backend and n <= world_size),
                    default=None)
        if first is not None:
            pytest.fail(f"not started: a {backend} pool of {first} ranks failed to start "
                        f"earlier in this run: {self.failed[backend, first]}", pytrace=False)
        try:
            self.live[key] = self._start(world_size, backend=backend)
        except WorkerError as e:
            self.failed[key] = str(e).splitlines()[0]
            raise
        return self.live[key]

    def close(self):
        for pool in self.live.values():
            pool.close()


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def installed_env():
    """The environment of a command run from another directory, the package importable as
    after `pip install -e .`."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


def process_gone(pid):
    """Whether process `pid` has ended (a zombie not yet reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


class Background:
    """Commands that run the package as a reader runs it (a fresh Python, a torch import, ranks
    of their own: seconds each, mostly spent waiting), run beside the in-process tests from the
    session's start; the test that owns one waits for its result. Only the commands of the
    tests selected in this run start (conftest.py).

    At most `at_once` run at a time, in the order queued (the tests' order), and a command a
    test asks for starts at once: a dozen torch imports started together would take both cores
    from the in-process tests for half a minute, and leave them idle later."""

    def __init__(self, folder, at_once=2):
        self.folder, self.procs, self.queued, self.at_once = folder, {}, [], at_once
        self.lock, self.closed = threading.Lock(), False
        threading.Thread(target=self._feed, daemon=True).start()

    def start(self, name, argv, cwd=ROOT, env=None):
        """Queue `argv`, to run in `cwd` (default: the repository's root, where `python -m
        tensor_parallel_toy` finds the package without an install)."""
        with self.lock:
            self.queued.append((name, dict(argv=argv, cwd=cwd, env=env)))

    def _launch(self, name, argv, cwd, env):
        out, err = (open(os.path.join(self.folder, f"{name}.{kind}"), "w+")
                    for kind in ("out", "err"))
        self.procs[name] = (subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err,
                                             text=True), out, err)

    def _feed(self):
        """Start the next queued commands whenever fewer than `at_once` run."""
        while not self.closed:
            with self.lock:
                running = sum(p.poll() is None for p, _, _ in self.procs.values())
                while self.queued and running < self.at_once and not self.closed:
                    self._launch(*self.queued[0][:1], **self.queued.pop(0)[1])
                    running += 1
            time.sleep(0.05)

    def _started(self, name):
        """The command `name`, started now if it is still queued."""
        with self.lock:
            for i, (queued, kwargs) in enumerate(self.queued):
                if queued == name:
                    self.queued.pop(i)
                    self._launch(name, **kwargs)
                    break
            return self.procs[name]

    def pid(self, name):
        return self._started(name)[0].pid

    def first_line(self, name, timeout=120):
        """The first line the command `name` printed, once it has (the command still runs)."""
        proc, out, _ = self._started(name)
        deadline = time.monotonic() + timeout
        while True:
            with open(out.name) as f:
                line = f.readline()
            if line.endswith("\n") or proc.poll() is not None or time.monotonic() > deadline:
                return line
            time.sleep(0.1)

    def kill(self, name):
        proc = self._started(name)[0]
        proc.kill()
        proc.wait()

    def result(self, name, timeout=300):
        """(exit status, stdout, stderr) of the command started as `name`."""
        proc, out, err = self._started(name)
        try:
            proc.wait(timeout=timeout)
        finally:
            proc.kill()
        out.seek(0), err.seek(0)
        return proc.returncode, out.read(), err.read()

    def close(self):
        with self.lock:
            self.closed = True
        for proc, out, err in self.procs.values():
            proc.kill()
            proc.wait()
            out.close(), err.close()
