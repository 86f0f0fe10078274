"""How a program that owns a `WorkerPool` stops on a signal. Inside `stop_on_signals()`, SIGTERM
and SIGINT raise `Stopped`, an exit with the shell's status for a signal (128 + its number):
the pool, left by it, kills its workers and releases its queues, and the fork server is killed
on the way out. SIGTERM's default would end the launcher where it stands, its workers and the
fork server left running and its queues' semaphores leaked; SIGINT's, KeyboardInterrupt, ends
in a traceback. `signals_held()` keeps a signal from cutting a worker's start in half.
"""
import contextlib
import os
import signal
import sys
import threading


class Stopped(SystemExit):
    """SIGTERM or SIGINT arrived inside `stop_on_signals`: an exit, with the shell's status for
    a signal (128 + its number: 143, 130), that runs the `with` blocks and `finally` clauses
    on its way out."""

    def __init__(self, signum):
        super().__init__(128 + signum)
        self.signal = signal.Signals(signum)

    def __str__(self):
        return f"stopped by {self.signal.name}"


@contextlib.contextmanager
def stop_on_signals(*signums):
    """While inside, each of `signums` (e.g. SIGTERM, SIGINT) raises `Stopped` in the main
    thread, so that a pool is left by an exception and kills its workers; as `Stopped` leaves,
    the fork server is killed too. SIGTERM's default would end this process where it stands:
    its workers and the fork server kept running and the queues' semaphores leaked. Once a
    signal has arrived, the others are ignored, so that nothing cuts the cleanup short; the
    previous handlers come back on leaving. Outside the main thread (where Python cannot set
    handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        for s in signums:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)
    previous = {s: signal.signal(s, stop) for s in signums}
    try:
        yield
    except Stopped:
        _end_fork_server()
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_held(*signums):
    """Hold `signums` back while inside (a few milliseconds) and deliver any that arrived on
    leaving, to whatever handles them then. Only the main thread can; elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = []

    def hold(signum, frame):
        arrived.append(signum)
    previous = {s: signal.signal(s, hold) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if arrived:
            signal.raise_signal(arrived[0])


def _end_fork_server():
    """Kill multiprocessing's fork server, as a stopped program leaves. Left alone, it sees the
    launcher's exit only once that exit is over, then tears down its own torch; caught still
    importing torch, it first finishes that. Meanwhile it holds the caller's pipes open (0.6 s
    to 1.5 s more, measured). The next start launches a new one. multiprocessing keeps the
    server's pid private: hence getattr, and nothing done where it is not there."""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
