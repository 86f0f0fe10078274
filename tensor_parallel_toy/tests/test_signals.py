"""Signals, tried as a user would: the profile started the way a wrapper script or a CI runner
starts it (its own session, its output read through pipes to their end), then stopped.

SIGTERM or SIGINT at any moment of the run ends it within 5 s with status 128 + the signal,
leaves no process of its session (fork server, resource tracker, workers) and no leaked
semaphore, and leaves the previous run's results as they were. A launcher killed outright
(SIGKILL: no cleanup possible) still takes its processes with it within 5 s, even while its
parent, still reading the output, has not reaped it.
"""
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from tensor_parallel_toy.tests.processes import ROOT, installed_env

STOP_WITHIN_S = 5
# Tiny (one mode beside the baseline), and long enough in training (6 steps) for a signal to
# land inside it.
FLAGS = ["--steps", "6", "--warmup", "1", "--batch", "2", "--seq", "16", "--hidden", "32",
         "--heads", "4", "--ffn", "64", "--layers", "1", "--bench-iters", "0",
         "--timeline-iters", "0", "--modes", "baseline,tp"]
PREVIOUS = {"results.json": '{"from": "the previous run"}\n', "summary.txt": "previous\n"}


def session_processes(sid):
    """The live processes of session `sid` (a zombie has ended; only its parent's wait is
    missing), as (pid, parent pid, command)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid, _, session = f.read().rsplit(")", 1)[1].split()[:4]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(session) == sid and state not in ("Z", "X"):
            found.append((int(pid), int(ppid), command))
    return found


class Profile:
    """`python -m tensor_parallel_toy profile` in its own session, stdout and stderr read to
    their end by two threads (what `communicate` does): the end of both pipes is the moment
    the caller gets control back, once every process holding them has gone."""

    def __init__(self, out=None, argv=None):
        self.proc = subprocess.Popen(
            argv or [sys.executable, "-m", "tensor_parallel_toy", "profile", *FLAGS, "--out", out],
            cwd=ROOT, env=installed_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        self.lines, self.stdout, self.stderr = queue.Queue(), [], []
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout,
                                                                  self.lines), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr,
                                                                  self.stderr, None),
                                         daemon=True)]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(pipe, into, lines):
        for line in pipe:
            into.append(line)
            if lines is not None:
                lines.put(line)
        if lines is not None:
            lines.put(None)

    def wait_for(self, text, timeout=120):
        """Block until a line of stdout holds `text`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {text!r} within {timeout} s:\n{self.output()}")
            assert line is not None, f"the run ended before printing {text!r}:\n{self.output()}"
            if text in line:
                return

    def stop(self, signum, group=False):
        """Send `signum` to the launcher (`group`: to every process of the session, as Ctrl-C in
        a terminal does); return the seconds until both pipes ended, the launcher was reaped
        (the pipes first, as a caller that reads the output before it waits) and no process
        of the session was left (one that closed the pipes may still be exiting), or until
        STOP_WITHIN_S gave up."""
        start = time.monotonic()
        deadline = start + STOP_WITHIN_S
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        for reader in self.readers:
            reader.join(timeout=max(0.0, deadline - time.monotonic()))
        if not any(reader.is_alive() for reader in self.readers):
            try:
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while session_processes(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return time.monotonic() - start

    def output(self):
        return "".join(self.stdout)[-1500:] + "\n--- stderr ---\n" + "".join(self.stderr)[-3000:]

    def kill(self):
        """Whatever happened, nothing of the session survives the test."""
        for pid, _, _ in session_processes(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()
        for reader in self.readers:  # at the pipes' end now that no process holds them
            reader.join(timeout=5)
        self.proc.stdout.close(), self.proc.stderr.close()


@pytest.fixture
def previous_results(tmp_path):
    """An --out folder holding a previous run's files."""
    for name, text in PREVIOUS.items():
        (tmp_path / name).write_text(text)
    return str(tmp_path)


@pytest.fixture
def profile(previous_results):
    runs = []

    def start():
        runs.append(Profile(previous_results))
        return runs[-1]
    yield start
    for run in runs:
        run.kill()


def _when_the_pool_starts(run, out):
    run.wait_for("spawning")


def _when_a_step_is_done(run, out):
    run.wait_for("step   1/")


def _when_the_ranks_form_their_group(run, out):
    """Block until the fork server has forked the ranks (its children), which then form their
    group: the moment the launcher used to be killed at once and the rest kept running."""
    _wait_until(run, lambda: sum(ppid not in (run.proc.pid, 1) for _, ppid, _ in
                                 session_processes(run.proc.pid)) >= 2, "the ranks")


def _when_the_report_is_written(run, out):
    """Block until the run renders its files (write_outputs' staging folder appears)."""
    _wait_until(run, lambda: any(name.startswith(".staging-") for name in os.listdir(out)),
                "the report")


def _wait_until(run, ready, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not ready():
        assert run.proc.poll() is None, f"the run ended before {what}:\n{run.output()}"
        assert time.monotonic() < deadline, f"no sign of {what} within {timeout} s:\n" \
                                            f"{run.output()}"
        time.sleep(0.01)


def _assert_left_as_it_was(out):
    left = {name: open(os.path.join(out, name)).read() for name in os.listdir(out)}
    assert left == PREVIOUS, f"the previous results changed: {left}"


# The moments: the pool starting (the fork server importing torch), the ranks forming their
# group, a training step, the report (plots drawn, nothing moved into place yet).
MOMENTS = {"starting": _when_the_pool_starts, "forming": _when_the_ranks_form_their_group,
           "training": _when_a_step_is_done, "report": _when_the_report_is_written}


# Three moments, each profile run a few seconds: start-up, the ranks forming their group
# (Ctrl-C in a terminal: SIGINT to every process of the job), the report. A training step
# is the SIGKILL test's moment below.
@pytest.mark.parametrize("signum, moment, group", [
    (signal.SIGTERM, "starting", False),
    (signal.SIGINT, "forming", True),
    (signal.SIGTERM, "report", False),
], ids=["SIGTERM-starting", "SIGINT-all-forming", "SIGTERM-report"])
def test_a_signal_at_any_moment_ends_the_run_in_5_s_with_128_plus_signal_leaving_nothing(
        profile, previous_results, signum, moment, group):
    run = profile()
    MOMENTS[moment](run, previous_results)
    took = run.stop(signum, group=group)
    name = signal.Signals(signum).name
    assert took < STOP_WITHIN_S and run.proc.returncode is not None, \
        f"{name} {moment}: still running after {took:.1f} s:\n{run.output()}"
    assert run.proc.returncode == 128 + signum, \
        f"{name} {moment}: exit status {run.proc.returncode}, expected {128 + signum}, " \
        f"in {took:.1f} s:\n{run.output()}"
    left = session_processes(run.proc.pid)
    assert not left, f"{name} {moment}: processes left {took:.1f} s after: {left}"
    # One line, ours: no leaked semaphore, no traceback of a worker or of the fork server.
    assert run.stderr == [f"python -m tensor_parallel_toy profile: stopped by {name}; its "
                          f"ranks are stopped\n"], f"{name} {moment}:\n{run.output()}"
    _assert_left_as_it_was(previous_results)


def test_a_sigkilled_launcher_not_yet_reaped_leaves_no_process_within_5_s(profile,
                                                                         previous_results):
    """SIGKILL allows no cleanup: the workers see the launcher has exited (a zombie, as its
    parent still reads the output before it waits) and leave; the fork server and the resource
    tracker follow them. The tracker then frees the semaphores the launcher could not."""
    run = profile()
    _when_a_step_is_done(run, previous_results)
    took = run.stop(signal.SIGKILL)
    assert took < STOP_WITHIN_S and run.proc.returncode == -signal.SIGKILL, \
        f"the output still open {took:.1f} s after SIGKILL (exit status " \
        f"{run.proc.returncode}):\n{run.output()}"
    left = session_processes(run.proc.pid)
    assert not left, f"processes left {took:.1f} s after SIGKILL: {left}"
    _assert_left_as_it_was(previous_results)


def test_an_example_started_by_launch_stops_on_sigterm_within_5_s_leaving_nothing():
    """`launch()`, which every example calls, stops its ranks on SIGTERM as the profile does:
    within 5 s, status 143, no process of its session left, nothing on stderr (no traceback,
    no leaked semaphore)."""
    run = Profile(argv=[sys.executable, "-m", "tensor_parallel_toy.examples.generate_tp",
                        "--steps", "100000"])
    try:
        # The launcher, the fork server and two ranks, then a moment inside training.
        _wait_until(run, lambda: len(session_processes(run.proc.pid)) >= 4, "the ranks")
        time.sleep(0.3)
        took = run.stop(signal.SIGTERM)
        assert took < STOP_WITHIN_S and run.proc.returncode == 128 + signal.SIGTERM, \
            f"exit status {run.proc.returncode} after {took:.1f} s:\n{run.output()}"
        left = session_processes(run.proc.pid)
        assert not left, f"processes left {took:.1f} s after: {left}"
        assert not "".join(run.stderr).strip(), run.output()
    finally:
        run.kill()
