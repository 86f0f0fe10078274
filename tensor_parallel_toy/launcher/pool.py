"""A local launcher that never leaves a rank hanging: `WorkerPool(n)` starts n local worker
processes, forms their process group once, and runs any picklable function on all of them, as
often as asked (the tests reuse one pool per world size). It watches its workers: if one raises
or dies, it stops the others and raises `WorkerError`, whose first line names the rank and the
cause, instead of waiting forever in a collective. `launch` runs a function either on such a
pool or, under torchrun, on this rank.

Left by an exception, a pool kills its workers: how a program turns SIGTERM and SIGINT into one
is signals.py. A launcher killed outright takes its workers with it all the same: they watch
it. What a failed rank said, and how it is put in words, is rank_output.py.
"""
import os
import queue
import signal
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver, parent_process

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .initialize import (DEFAULT_TIMEOUT_S, bind_gpu, choose_backend, gpu_count, init_from_env,
                         nccl_options, set_threads, share_gpu_env, shutdown)
from .rank_output import (RANK_LOGS_ENV, exit_meaning, last_lines, last_words, raised,
                          rank_log, remove_if_empty, stderr_to)
from .signals import signals_held, stop_on_signals


class WorkerError(RuntimeError):
    """A worker rank raised, died, or did not answer in time."""


def _exit_with_launcher():
    """If the launcher exits (even by SIGKILL, and before whoever started it has reaped it), its
    workers must not linger waiting for tasks; nor may a worker whose start the launcher gave
    up. multiprocessing hands each worker the read end of a pipe that only the launcher holds
    open, for this very use: the watch wakes when it closes, at no cost before."""
    def watch():
        parent_process().join()
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()


def _start_context():
    """How workers start: forked from a fork server that imported torch and this package once,
    so a pool starts in a fraction of a second instead of a few seconds per rank (a spawned
    process imports torch anew). The server does nothing but import: no thread pool, no CUDA,
    so its children start as clean as spawned ones, and each worker takes the launcher's
    environment as it is when the pool starts (`_worker_main`). Where there is no fork server
    (Windows), spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Not "__main__": where honoured it would run a user script's top level in the server.
    ctx.set_forkserver_preload(["tensor_parallel_toy"])  # read once it starts
    return ctx


# torch's import turns its CUDA sanitizer on where this is set (gpu-check's sanitizer step).
SANITIZER_ENV = "TORCH_CUDA_SANITIZER"


def _start_fork_server(ctx):
    """Have the fork server ready before any worker starts: the first time, it imports torch
    (seconds), and a signal meanwhile must stop the launcher at once, which a held start
    (`signals.signals_held`) would not. This start carries nothing (no queue, no store), so
    cutting it short is harmless.

    The server imports torch without SANITIZER_ENV: with the sanitizer on, every tensor op
    touches CUDA, and a server that initialised CUDA leaves every worker forked from it unable
    to ("Cannot re-initialize CUDA in forked subprocess"). Each worker turns the sanitizer on
    itself (`_worker_main`).

    The server is spawned with SIGINT blocked (the launcher's own block lasts that fork and
    exec, milliseconds; a SIGINT meanwhile arrives after it): the server and every worker it
    forks inherit the block, so a Ctrl-C to the whole job, which reaches a worker before its
    first line ignores SIGINT, stays pending there instead of raising KeyboardInterrupt in its
    start-up (a traceback on the launcher's stderr, measured in about 1 of 12 stops under
    load); the worker unblocks it once ignored."""
    if ctx.get_start_method() == "forkserver":
        sanitizer = os.environ.pop(SANITIZER_ENV, None)
        try:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                forkserver.ensure_running()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            proc = ctx.Process(target=os.getpid, daemon=True)
            proc.start()
            proc.join()
        finally:
            if sanitizer is not None:
                os.environ[SANITIZER_ENV] = sanitizer


def _turn_on_cuda_sanitizer():
    """PyTorch's documented switch (torch.cuda._sanitizer), once per process."""
    import torch.cuda._sanitizer as csan

    if not csan.cuda_sanitizer.enabled:
        csan.enable_cuda_sanitizer()


# Set to one of INJECTABLE, a worker fails on purpose, so that a run on CPU shows what a
# failure on a GPU reports (gpu-check's tests): the last rank raises in its first task, aborts
# in it (exit -6, as NCCL's watchdog aborts a rank), or never joins the process group.
INJECT_ENV = "TENSOR_PARALLEL_TOY_INJECT_FAILURE"
INJECTABLE = ("raise", "abort", "hang-at-start")


def _injected(stage, rank, world_size):
    what = os.environ.get(INJECT_ENV)
    if not what or rank != world_size - 1:
        return
    if what not in INJECTABLE:
        raise ValueError(f"{INJECT_ENV}={what!r}: valid are {', '.join(INJECTABLE)}")
    if stage == "start" and what == "hang-at-start":
        time.sleep(1 << 20)  # the parent watch ends it with the launcher
    if stage == "task" and what == "raise":
        raise RuntimeError(f"injected by {INJECT_ENV}=raise: the error a failed collective "
                           f"raises")
    if stage == "task" and what == "abort":  # after its last words, as NCCL's watchdog
        os.write(2, f"injected by {INJECT_ENV}=abort: a rank's last words\n".encode())
        os.abort()


def _worker_main(rank, world_size, port, backend, timeout_s, tasks, results, environ,
                 high_priority_streams=False, log=None):
    if log:
        stderr_to(log)
    # Ctrl-C in a terminal signals every process of the job: the launcher decides what a stop
    # means, and stops its workers itself. Born with SIGINT blocked (_start_fork_server): a
    # Ctrl-C already pending is dropped once ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # POSIX
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # A forked worker inherits the fork server's environment, from when it started: take the
    # launcher's as it is now, as a spawned worker would.
    os.environ.clear()
    os.environ.update(environ)
    if os.environ.get(SANITIZER_ENV) and torch.cuda.is_available():
        _turn_on_cuda_sanitizer()  # as torch's import would have, in this process
    _exit_with_launcher()
    try:
        if torch.cuda._is_in_bad_fork():  # CUDA's first use would fail less clearly
            raise RuntimeError("this rank was forked from a fork server that had initialised "
                               "CUDA, so it cannot use CUDA; the server must only import "
                               "(pool._start_fork_server)")
        _injected("start", rank, world_size)
        nccl = {}
        if backend == "nccl":
            if gpu_count() < world_size:  # SHARE_GPU_ENV: choose_backend allowed it
                os.environ.update(share_gpu_env(rank))
            nccl = {"device_id": bind_gpu(rank, world_size),
                    "pg_options": nccl_options(high_priority_streams)}
        else:
            set_threads(world_size)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **nccl)
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            _injected("task", rank, world_size)
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    shutdown()


class WorkerPool:
    """`world_size` local ranks in one process group, reused across many `run` calls.

    Under NCCL rank r binds GPU r (all ranks GPU 0 when SHARE_GPU_ENV=1 lets them share one);
    `high_priority_streams`: see `nccl_options`.

    `log_dir` (default: RANK_LOGS_ENV's folder, if set; gpu-check sets it for each step, the
    suite's pools use a temporary one): each rank's stderr goes to a new file,
    LOG_DIR/rank<r>-of-<n>.log (removed at the end if the rank said nothing), instead of
    the launcher's, and a WorkerError quotes the failed rank's last lines. Without it a forked
    worker writes where the fork server's stderr pointed when the server started: the
    launcher's terminal for a command, but under pytest the capture of the test that started
    the server, never shown."""

    def __init__(self, world_size, backend=None, timeout_s=DEFAULT_TIMEOUT_S,
                 high_priority_streams=False, start_timeout_s=None, log_dir=None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size {world_size!r} must be a positive integer")
        devices = {None: "auto", "gloo": "cpu", "nccl": "cuda"}
        if backend not in devices:
            raise ValueError(f"backend {backend!r} is not one of: gloo, nccl")
        self.world_size = world_size
        self.backend = choose_backend(world_size, devices[backend])  # checks the GPU count
        self.timeout_s = timeout_s
        log_dir = log_dir or os.environ.get(RANK_LOGS_ENV) or None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        self.logs = [rank_log(log_dir, r, world_size) if log_dir else None
                     for r in range(world_size)]
        # The store lives here, on a port the OS picked (port 0): two pools, or a pool and a
        # torchrun job, can never collide on a port.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        ctx = _start_context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_worker_main, daemon=True, name=f"tp-rank-{rank}",
                        args=(rank, world_size, self._store.port, self.backend, timeout_s,
                              self._tasks[rank], self._results, dict(os.environ),
                              high_priority_streams, self.logs[rank]))
            for rank in range(world_size)]
        try:
            _start_fork_server(ctx)
            # Each start is held whole: cut in half by a signal, it would leave a worker forked
            # whose pid the launcher never learned, and so could not stop.
            with signals_held(signal.SIGTERM, signal.SIGINT):
                for proc in self._procs:
                    proc.start()
            self._collect("ready", start_timeout_s or timeout_s + 60)
        except BaseException:  # a stop (a signal) while the pool starts
            self.close(graceful=False)
            raise

    @property
    def alive(self):
        return self._procs is not None and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout_s=None, **kwargs):
        """Run `fn(*args, **kwargs)` on every rank; return the per-rank results in rank order."""
        if not self.alive:
            raise WorkerError("the worker pool is closed")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect("ok", timeout_s or self.timeout_s * 2)

    def _collect(self, expected, timeout_s):
        got, deadline = {}, time.monotonic() + timeout_s
        starting = f" while forming the {self.backend} process group" \
            if expected == "ready" else ""
        while len(got) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(got))
            try:
                rank, status, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                self._raise_if_a_rank_died()
                if time.monotonic() > deadline:
                    self.close(graceful=False)
                    raise WorkerError(f"no answer from ranks {missing} within "
                                      f"{timeout_s:.0f} s{starting}; stopped all ranks"
                                      + self._output_of(missing)) from None
                continue
            if status == "error":
                cause = raised(payload)
                # When a rank dies, its peers soon raise "connection closed": give the launcher
                # a moment to see the death, so the error names the cause, not a consequence;
                # no need once every rank has answered (the usual case: all raised alike).
                self._await_answers_or_a_death({rank, *got}, time.monotonic() + 1.0)
                self._raise_if_a_rank_died(also=f"rank {rank} then raised: {cause}",
                                           besides=rank)  # it leaves after raising at start
                # The other ranks may be blocked in a collective this rank will never join.
                self.close(graceful=False)
                silent = [r for r in missing if r != rank]
                raise WorkerError(f"rank {rank} raised: {cause}" + (
                    f" ({starting.strip()}; no word from ranks {silent})" if starting and silent
                    else "") + f"\n{payload}" + self._output_of([rank]))
            assert status == expected, (status, expected)
            got[rank] = payload
        return [got[r] for r in range(self.world_size)]

    def _await_answers_or_a_death(self, answered, deadline):
        while len(answered) < self.world_size and time.monotonic() < deadline:
            if any(not p.is_alive() for r, p in enumerate(self._procs) if r not in answered):
                return
            try:
                answered.add(self._results.get(timeout=0.05)[0])
            except queue.Empty:
                pass

    def _raise_if_a_rank_died(self, also="", besides=None):
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs)
                if not p.is_alive() and r != besides]
        if dead:
            self.close(graceful=False)
            rank, code = dead[0]
            said = last_words(self.logs[rank]) if self.logs[rank] else None
            raise WorkerError(f"rank {rank} died ({exit_meaning(code)})"
                              + (f"; its last words: {said}" if said else "")
                              + "; stopped the other ranks" + (f"; {also}" if also else "")
                              + self._output_of([rank]))

    def _output_of(self, ranks):
        """The ranks' last lines, from their stderr files, for an error's later lines."""
        parts = []
        for rank in ranks:
            lines = last_lines(self.logs[rank]) if self.logs[rank] else []
            if lines:
                parts.append(f"\nrank {rank}'s last lines ({self.logs[rank]}):\n"
                             + "\n".join(f"  {line}" for line in lines))
        return "".join(parts)

    def close(self, graceful=True):
        """Ask the workers to leave cleanly; whoever does not within 10 s is killed.
        `graceful=False` kills at once (after an error the others may be stuck, after a signal
        nobody waits). Then the queues go, and with them their semaphores."""
        if self._procs is None:
            return
        started = [p for p in self._procs if p.pid is not None]  # a stop can come before some
        try:
            for q in self._tasks if graceful else ():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + (10 if graceful else 0)
            for proc in started:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        finally:  # also when a signal cuts the wait short
            # Kill them all, then wait: waiting for each before killing the next would leave the
            # rest a moment to notice a dead peer and say so on stderr.
            alive = [p for p in started if p.is_alive()]
            for proc in alive:
                proc.kill()
            for proc in alive:
                proc.join(timeout=5)
            for q in [self._results, *self._tasks]:
                q.cancel_join_thread()  # no worker is left to read what it still holds
                q.close()
            self._procs = self._results = self._tasks = None
            remove_if_empty(self.logs)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # Left by an exception, the workers may be in the middle of a task nobody will collect.
        self.close(graceful=exc_type is None)


def launch(main, world_size=2, *args):
    """Run `main(*args)` on every rank, the way an example is started either way.

    Under torchrun (RANK and WORLD_SIZE set) this process is one rank: join the group with
    `init_from_env`, run `main`, leave with `shutdown`, and return `[main's result]` (this
    rank's only). Otherwise start `world_size` local ranks (a `WorkerPool`) and return every
    rank's result in rank order; meanwhile SIGTERM and SIGINT, where the program left them to
    Python's defaults, stop it with its ranks (signals.py; its exit status 128 + the signal).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_from_env()
        try:
            return [main(*args)]
        finally:
            shutdown()
    with stop_on_signals(*_unclaimed(signal.SIGTERM, signal.SIGINT)):
        with WorkerPool(world_size) as pool:
            return pool.run(main, *args)


def _unclaimed(*signums):
    """Those of `signums` whose handler is still Python's default: a program's own stays."""
    default = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    return [s for s in signums if signal.getsignal(s) is default[s]]
