"""Process groups, devices, and a local launcher that never leaves a rank hanging.

Two ways in:
- `torchrun ... python -m tensor_parallel_toy profile`: the environment carries RANK, WORLD_SIZE
  and MASTER_ADDR/PORT, and `init_from_env()` joins that group (multi-GPU, multi-node).
- `WorkerPool(n)`: spawns n local worker processes, forms their process group once, and runs
  any picklable function on all of them, as often as asked (the tests reuse one pool per world
  size). It watches its workers: if one raises or dies, it stops the others and raises an error
  naming the rank, instead of waiting forever in a collective.
"""
import os
import queue
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0


class WorkerError(RuntimeError):
    """A worker rank raised, died, or did not answer in time."""


DEVICES = ("auto", "cpu", "cuda")


def choose_backend(world_size, device="auto"):
    """NCCL with one GPU per rank when there are enough GPUs, otherwise gloo on CPU."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of: {', '.join(DEVICES)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu" or (device == "auto" and gpus < world_size):
        return "gloo"
    if gpus == 0:
        raise ValueError("device=cuda was requested but no CUDA GPU is available; "
                         "use device=cpu (or auto)")
    if gpus < world_size:
        raise ValueError(f"device=cuda with {world_size} ranks needs {world_size} GPUs, "
                         f"found {gpus}; use at most {gpus} ranks or device=cpu")
    return "nccl"


def current_device():
    """The device this rank computes on: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _set_threads(world_size):
    # Ranks on one CPU machine share its cores; oversubscribing them makes every GEMM slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def init_from_env(backend=None, timeout_s=DEFAULT_TIMEOUT_S):
    """Join the process group described by torchrun's environment variables."""
    world_size = int(os.environ["WORLD_SIZE"])
    backend = backend or choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        _set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return backend


def shutdown():
    """Barrier first, so no rank tears down its connections while a peer is still using them."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _exit_with_parent(parent_pid):
    """If the launcher dies (even by SIGKILL), its workers must not linger waiting for tasks."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _worker_main(rank, world_size, port, backend, timeout_s, tasks, results, parent_pid):
    _exit_with_parent(parent_pid)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            _set_threads(world_size)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
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
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    shutdown()


class WorkerPool:
    """`world_size` local ranks in one process group, reused across many `run` calls."""

    def __init__(self, world_size, backend=None, timeout_s=DEFAULT_TIMEOUT_S):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size {world_size!r} must be a positive integer")
        devices = {None: "auto", "gloo": "cpu", "nccl": "cuda"}
        if backend not in devices:
            raise ValueError(f"backend {backend!r} is not one of: gloo, nccl")
        self.world_size = world_size
        self.backend = choose_backend(world_size, devices[backend])  # checks the GPU count
        self.timeout_s = timeout_s
        # The store lives here, on a port the OS picked (port 0): two pools, or a pool and a
        # torchrun job, can never collide on a port.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                    timeout=timedelta(seconds=timeout_s))
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_worker_main, daemon=True, name=f"tp-rank-{rank}",
                        args=(rank, world_size, self._store.port, self.backend, timeout_s,
                              self._tasks[rank], self._results, os.getpid()))
            for rank in range(world_size)]
        for proc in self._procs:
            proc.start()
        self._collect("ready", timeout_s + 60)  # spawning imports torch: allow for a slow start

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
        while len(got) < self.world_size:
            try:
                rank, status, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                self._raise_if_a_rank_died()
                if time.monotonic() > deadline:
                    self.close(graceful=False)
                    raise WorkerError(f"no answer from ranks "
                                      f"{sorted(set(range(self.world_size)) - set(got))} "
                                      f"within {timeout_s:.0f} s; stopped all ranks") from None
                continue
            if status == "error":
                # When a rank dies, its peers soon raise "connection closed": give the launcher
                # a moment to see the death, so the error names the cause, not a consequence.
                time.sleep(1.0)
                self._raise_if_a_rank_died(also=f"rank {rank} then raised: "
                                                f"{payload.strip().splitlines()[-1]}")
                # The other ranks may be blocked in a collective this rank will never join.
                self.close(graceful=False)
                raise WorkerError(f"rank {rank} raised:\n{payload}")
            assert status == expected, (status, expected)
            got[rank] = payload
        return [got[r] for r in range(self.world_size)]

    def _raise_if_a_rank_died(self, also=""):
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]
        if dead:
            self.close(graceful=False)
            rank, code = dead[0]
            raise WorkerError(f"rank {rank} died (exit code {code}); stopped the other ranks"
                              + (f"; {also}" if also else ""))

    def close(self, graceful=True):
        """Ask the workers to leave cleanly; whoever does not within 10 s is killed.
        `graceful=False` kills at once (after an error the others may be stuck)."""
        if self._procs is None:
            return
        for q in self._tasks if graceful else ():
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (10 if graceful else 0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
