"""gpu-check runs on CPU exactly as it will on a GPU: the rehearsal takes every step through the
same subprocesses, time limits, result files and summary; a step past its limit is stopped with
everything it started; one GPU needs the sharing switch, given by flag or variable alike.

Failures are rehearsed too: a rank that raises, one that aborts, one that never joins the
group (TENSOR_PARALLEL_TOY_INJECT_FAILURE), and a pool that cannot start; each is named in the
summary's first lines with its step, its test and its cause.
"""
import concurrent.futures
import dataclasses
import os
import pathlib
import re
import sys
import time
import types

import pytest

from tensor_parallel_toy.launcher import gpu_check, initialize, machine, smoke
from tensor_parallel_toy.launcher.gpu_check import Step, run_step
from tensor_parallel_toy.launcher import gpu_report
from tensor_parallel_toy.launcher.gpu_report import read_report, summary
from tensor_parallel_toy.launcher.initialize import SHARE_GPU_ENV
from tensor_parallel_toy.launcher.pool import INJECT_ENV, WorkerError
from tensor_parallel_toy.tests.helpers import assert_one_line
from tensor_parallel_toy.tests.processes import Pools, process_gone

REHEARSED = ["nccl-smoke"]  # the test steps run in the failure rehearsal below (one of them
# passing), the profile step's command in test_profiling
# One quick [gloo] test for the rehearsal's test steps: a step passes only if a test of its
# backend passed, so the selection must hold one.
ONE_GLOO_TEST = "matches_full_linear and 2-column-overlap-bias-fp32"


def _rehearsal(folder):
    """The one-GPU plan (the machine most likely to turn up) as a reader runs it, its first step
    only; --share-gpu must set the sharing switch itself, so it is unset here."""
    env = {k: v for k, v in os.environ.items() if k != SHARE_GPU_ENV}
    return dict(argv=[sys.executable, "-m", "tensor_parallel_toy", "gpu-check", "--rehearse",
                      "--share-gpu", "--out", os.path.join(folder, "rehearsal"), "--tests",
                      ONE_GLOO_TEST, "--steps", ",".join(REHEARSED)], env=env)


BACKGROUND = {"rehearsal": _rehearsal}


@pytest.mark.background("rehearsal")
def test_rehearsal_runs_every_step_on_cpu_and_its_summary_says_what_passed(background):
    """The summary file, the screen, the log, the sharing route."""
    code, printed, err = background.result("rehearsal")
    out = pathlib.Path(background.folder) / "rehearsal"
    assert code == 0, printed[-4000:] + err[-2000:]
    block = (out / "summary.txt").read_text()
    first = block.splitlines()[0]
    assert first == (f"{gpu_check.PROG} --rehearse: 1 of 1 steps passed; results in {out}/ "
                     f"(summary.txt, a .log per step)"), block
    assert printed.endswith(block), printed[-2000:]
    for name in REHEARSED:
        assert f"\n=== {name}: passed" in printed, printed[-4000:]
        assert (out / f"{name}.log").stat().st_size > 0, name
    lines = {line.split()[1]: line for line in block.splitlines()[1:] if line.startswith("  ")}
    assert "all-reduce, ring step and barrier correct" in (out / "nccl-smoke.log").read_text()
    assert lines["nccl-smoke"].split()[0] == "passed" and set(lines) == {*REHEARSED,
                                                                       "large-overlap"}
    assert lines["large-overlap"].split()[0] == "skipped", block
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1 where NCCL >= 2.30" in block, block
    assert "correctness, not speed" in block, block


def test_rehearsal_takes_the_gpu_runs_steps_with_only_backend_device_and_sizes_changed(tmp_path):
    out = str(tmp_path)
    for gpus in (1, 2):
        real = gpu_check.plan(gpus, True, out)
        rehearsal = gpu_check.plan(gpus, True, out, rehearse=True)
        assert [s.name for s in rehearsal] == [s.name for s in real]
        assert real[0].name == "nccl-smoke" and real[0].stops_run
        for r, g in zip(rehearsal, real):
            assert (r.timeout_s, r.results, r.report) == (g.timeout_s, g.results, g.report)
            assert r.argv[:4] == g.argv[:4], (r.argv, g.argv)  # python -m package test|profile
            assert {**r.env, "TORCH_CUDA_SANITIZER": "1"} == {**g.env, "TORCH_CUDA_SANITIZER":
                                                              "1"}, r.name
            if g.report:  # the gloo twin of each NCCL test
                assert r.argv[5] == g.argv[5].replace("nccl", "gloo"), (r.argv, g.argv)
                assert (r.backend, g.backend) == ("gloo", "nccl")
            else:
                at = r.argv.index("--device")
                assert r.argv[at + 1] == "cpu" and g.argv[at + 1] == "cuda", (r.argv, g.argv)
    narrowed = [s for s in gpu_check.plan(1, True, out, tests="ring_buffers") if s.report]
    assert [s.argv[5] for s in narrowed] == ["nccl and (ring_buffers)"] * 2, narrowed


def test_a_hang_at_process_group_start_fails_the_smoke_step_in_seconds_and_stops_the_run(
        tmp_path, monkeypatch, capsys):
    """A rank that never joins the group: the smoke check names it within its ranks' timeout
    (3 s here), and gpu-check runs nothing after a failed smoke step. (The check runs in this
    process; the step that prints its line is a stand-in, to spare a second start of torch.)"""
    monkeypatch.setenv(INJECT_ENV, "hang-at-start")
    start = time.monotonic()
    passed, line = smoke.run("cpu", timeout_s=3)
    assert not passed and time.monotonic() - start < 3 + 30, time.monotonic() - start
    assert line.startswith("FAILED smoke: rank 0 raised: ") and line.endswith(
        "(while forming the gloo process group; no word from ranks [1])"), line
    monkeypatch.delenv(INJECT_ENV)
    steps = gpu_check.plan(1, True, str(tmp_path / "gpu"), rehearse=True)
    steps[0].argv = [sys.executable, "-c", f"print({line!r}); raise SystemExit(1)"]
    monkeypatch.setattr(gpu_check, "plan", lambda *args, **kwargs: steps)
    assert gpu_check.main(["--rehearse", "--share-gpu", "--out", str(tmp_path / "gpu")]) == 1
    capsys.readouterr()
    block = (tmp_path / "gpu" / "summary.txt").read_text().splitlines()
    assert block[0].startswith(f"{gpu_check.PROG} --rehearse: 0 of 4 steps passed; FAILED: "
                               f"nccl-smoke; not run: nccl-tests, sanitizer, profile;"), block
    assert block[1].split()[:2] == ["FAILED", "nccl-smoke"], block
    assert block[2] == f"      | {line}", block
    assert [line.split()[:2] for line in block[3:6]] == [
        ["not", "run"]] * 3 and "nccl-smoke failed" in block[3], block
    assert not (tmp_path / "gpu" / "nccl-tests.log").exists()


_SUMMARY_MARK = "=== the rehearsal's summary ==="


def rehearse_failures(out):
    """The suite's own test steps, one [gloo] test each: one with a rank that raises, one with a
    rank that aborts (exit -6, as NCCL's watchdog aborts one), one as it is; run together (they
    mostly wait), their summary printed after `_SUMMARY_MARK`. A background command (below)."""
    planned = gpu_check.plan(1, True, out, rehearse=True, tests=ONE_GLOO_TEST)
    steps = {s.name: s for s in planned}
    steps["again"] = dataclasses.replace(steps["nccl-tests"], name="again", env={
        **steps["nccl-tests"].env}, argv=[a.replace("nccl-tests.xml", "again.xml") for a in
                                          steps["nccl-tests"].argv],
        report=steps["nccl-tests"].report.replace("nccl-tests.xml", "again.xml"))
    injected = [("nccl-tests", "raise"), ("sanitizer", "abort"), ("again", None)]
    for name, what in injected:
        if what:
            steps[name].env[INJECT_ENV] = what
        # Collect that test's file only: a quicker start.
        steps[name].argv.append(os.path.join(os.path.dirname(__file__), "test_parallel_linear.py"))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # they mostly wait: run together
        outcomes = list(pool.map(lambda job: run_step(steps[job[0]], out), injected))
    print(_SUMMARY_MARK, summary(outcomes, out), sep="\n")


BACKGROUND["failure rehearsal"] = lambda folder: dict(argv=[
    sys.executable, "-c", "import sys; from tensor_parallel_toy.tests.test_gpu_check import "
    "rehearse_failures; rehearse_failures(sys.argv[1])", folder])


@pytest.mark.background("failure rehearsal")
def test_a_failing_test_and_a_dying_rank_are_named_with_their_cause_before_what_passed(
        background):
    """The summary's first lines name each failed step, its test and the cause, read from
    pytest's JUnit report; the step that passed, its one [gloo] test counted, comes after them
    (`rehearse_failures`, run in the background from the session's start)."""
    code, printed, err = background.result("failure rehearsal")
    assert code == 0 and _SUMMARY_MARK in printed, (code, printed[-3000:], err[-3000:])
    block = printed.split(_SUMMARY_MARK, 1)[1].strip().splitlines()
    assert "1 of 3 steps passed; FAILED: nccl-tests, sanitizer;" in block[0], block
    test = "test_parallel_linear::test_parallel_linear_matches_full_linear[2-column-overlap-"
    assert block[1].split()[:2] == ["FAILED", "nccl-tests"] and "1 failed" in block[1], block
    assert block[2].startswith(f"      | {test}"), block
    assert (": WorkerError: rank 1 raised: RuntimeError: injected by "
            f"{INJECT_ENV}=raise") in block[2], block
    assert block[3].split()[:2] == ["FAILED", "sanitizer"] and "1 failed" in block[3], block
    assert block[4].startswith(f"      | {test}"), block
    assert ": WorkerError: rank 1 died (exit code -6, SIGABRT: an abort, as NCCL's watchdog" \
        in block[4], block
    # What the rank wrote before it died, whatever pytest captured, and where the rest is.
    assert (f"watchdog aborts a rank whose collective failed or timed out); its last words: "
            f"injected by {INJECT_ENV}=abort: a rank's last words; stopped") in block[4], block
    assert block[5].startswith("      | ranks' own stderr: ") and \
        block[5].endswith("sanitizer-ranks/ (rank1-of-2.log)"), block
    assert block[6].split()[:2] == ["passed", "again"] and "1 passed" in block[6], block


def test_a_pool_that_failed_to_start_fails_later_tests_at_once_with_its_first_error():
    started = []

    def start(world_size, backend):
        started.append((backend, world_size))
        if world_size >= 3:
            raise WorkerError("rank 2 raised: DistBackendError: NCCL error: unhandled cuda "
                              "error\nTraceback ...")
        return types.SimpleNamespace(alive=True, close=lambda: None)

    pools = Pools(start)
    with pytest.raises(WorkerError):
        pools.get(3, "gloo")
    for world_size in (3, 4):  # as many ranks or more: not tried again
        with pytest.raises(pytest.fail.Exception) as failed:
            pools.get(world_size, "gloo")
        assert str(failed.value) == ("not started: a gloo pool of 3 ranks failed to start "
                                     "earlier in this run: rank 2 raised: DistBackendError: "
                                     "NCCL error: unhandled cuda error"), failed.value
    pools.get(2, "gloo")  # fewer ranks may still start
    assert started == [("gloo", 3), ("gloo", 2)], started


def test_a_junit_report_gives_each_failed_test_with_its_cause_and_counts_the_backends_tests(
        tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite tests="5">'
        '<testcase classname="pkg.tests.test_a" name="test_x[nccl]"/>'
        '<testcase classname="pkg.tests.test_a" name="test_nccl_env"/>'
        '<testcase classname="pkg.tests.test_b" name="test_y[2-nccl]"><failure message='
        '"WorkerError: rank 1 raised: DistBackendError: NCCL error ... Cuda failure \'out of '
        'memory\'&#10;Traceback (most recent call last):">long</failure></testcase>'
        '<testcase classname="pkg.tests.test_b" name="test_z[gloo]"><skipped message="no GPU"/>'
        '</testcase><testcase classname="pkg.tests.test_b" name="test_w[nccl]"><error message='
        '"failed on setup"/></testcase></testsuite></testsuites>')
    tests = read_report(str(report), "nccl")
    assert tests.counts == ", 2 passed, 1 failed, 1 errors, 1 skipped", tests
    assert tests.backend_passed == 1, tests  # test_nccl_env has no [nccl] id: not counted
    assert tests.failures == [
        "test_b::test_y[2-nccl]: WorkerError: rank 1 raised: DistBackendError: NCCL error ... "
        "Cuda failure 'out of memory'", "test_b::test_w[nccl]: failed on setup"], tests
    assert tests.skip_reasons == ["no GPU"]
    assert read_report(str(tmp_path / "missing.xml")) == gpu_report.Tests()


def _sleeper(tmp_path):
    """A step that starts a child and then waits for ever, as a hung test step would with its
    ranks; writes the child's pid."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); "
            "print('started', flush=True); time.sleep(600)")
    return Step("sleeper", [sys.executable, "-c", code], {}, "sleeps", timeout_s=600), pid_file



def test_a_step_past_its_time_limit_is_stopped_with_its_children_and_reported(tmp_path, capsys):
    step, pid_file = _sleeper(tmp_path)
    start = time.monotonic()
    outcome = run_step(step, str(tmp_path), timeout_s=1)
    assert time.monotonic() - start < 20, "the step was not stopped at its limit"
    assert outcome.status == "TIMED OUT" and "stopped after 1 s" in outcome.detail, outcome
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not process_gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(child), f"the step's child {child} outlived it"
    assert "started" in (tmp_path / "sleeper.log").read_text()
    assert "started" in capsys.readouterr().out  # on the screen too, as it came
    first = summary([outcome], str(tmp_path)).splitlines()[0]
    assert "0 of 1 steps passed; TIMED OUT: sleeper; results in" in first, first


def test_a_failed_step_puts_its_failing_tests_in_the_summary_and_a_step_that_ran_nothing_fails(
        tmp_path):
    """Without a report (pytest died) the log's FAILED lines stand in; a step whose [backend]
    tests were all skipped fails, naming why they were skipped; an earlier run's report is
    removed before a step starts, never read as this run's."""
    failing = Step("nccl-tests", [sys.executable, "-c", "print('....F'); print('FAILED t.py::"
                                  "test_ring[nccl] - AssertionError: y=1.3'); raise SystemExit(1)"],
                   {}, "fails")
    skipped_xml, stale_xml = tmp_path / "skipped.xml", tmp_path / "stale.xml"
    all_skipped = ('<testsuites><testsuite><testcase name="test_a[nccl]"><skipped message="no '
                   'GPU"/></testcase><testcase name="test_nccl_words"/></testsuite></testsuites>')
    skipped_all = Step("sanitizer", [sys.executable, "-c", f"open({str(skipped_xml)!r}, 'w')."
                                     f"write({all_skipped!r})"], {}, "skips",
                       report=str(skipped_xml), backend="nccl")
    stale_xml.write_text('<testsuite><testcase name="test_a[nccl]"/></testsuite>')
    wrote_nothing = Step("profile", [sys.executable, "-c", "pass"], {}, "writes no report",
                         report=str(stale_xml), backend="nccl")
    outcomes = [run_step(step, str(tmp_path)) for step in (failing, skipped_all, wrote_nothing)]
    block = summary(outcomes, str(tmp_path))
    assert block.splitlines()[0].startswith(
        f"{gpu_check.PROG}: 0 of 3 steps passed; FAILED: nccl-tests, sanitizer, profile; "
        f"results in"), block
    assert "| FAILED t.py::test_ring[nccl] - AssertionError: y=1.3" in block, block
    assert "no [nccl] test passed, 1 passed, 1 skipped" in block and "| no GPU" in block, block
    assert "no [nccl] test passed; log profile.log" in block and not stale_xml.exists(), block


def test_one_gpu_needs_the_sharing_switch_and_the_flag_and_the_variable_are_the_same(
        monkeypatch, capsys):
    monkeypatch.delenv(SHARE_GPU_ENV, raising=False)
    assert gpu_check.main([], gpus=1) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--share-gpu" in err and f"{SHARE_GPU_ENV}=1" in err, err
    assert gpu_check.main(["--dry-run", "--share-gpu"], gpus=1) == 0
    by_flag = capsys.readouterr().out
    monkeypatch.setenv(SHARE_GPU_ENV, "1")
    assert gpu_check.main(["--dry-run"], gpus=1) == 0
    assert capsys.readouterr().out == by_flag
    assert by_flag.count(f"{SHARE_GPU_ENV}=1 ") == 4 and "large-overlap" not in by_flag, by_flag
    for bad, words in [("yes", [f"{SHARE_GPU_ENV}='yes'", "valid are 1"])]:
        monkeypatch.setenv(SHARE_GPU_ENV, bad)
        assert gpu_check.main(["--dry-run"], gpus=1) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(w in err for w in words), err


@pytest.mark.parametrize("version, words", [
    ((2, 30, 4), [initialize.MULTI_RANK_GPU_ENV, "NCCL 2.30.4 >= 2.30"]),
    ((2, 29, 7), ["per-rank NCCL_HOSTID", "NCCL 2.29.7 < 2.30"]),
])
def test_ranks_share_a_gpu_through_nccls_own_switch_where_it_exists(version, words):
    env = [initialize.share_gpu_env(rank, version) for rank in range(3)]
    if version >= initialize.MULTI_RANK_GPU_SINCE:
        assert env == [{initialize.MULTI_RANK_GPU_ENV: "1", **initialize.SOCKETS_ONLY}] * 3, env
    else:  # the same host id on two ranks: "Duplicate GPU detected"
        assert len({e["NCCL_HOSTID"] for e in env}) == 3, env
        assert all(initialize.MULTI_RANK_GPU_ENV not in e for e in env), env
    route = initialize.share_gpu_route(version)
    assert route.startswith("through ") and all(w in route for w in words), route



def test_two_ranks_per_gpu_through_nccls_switch_and_sockets_pinned_either_way(monkeypatch):
    monkeypatch.setattr(initialize, "gpu_count", lambda: 1)
    share = {SHARE_GPU_ENV: "1"}
    assert initialize.nccl_rank_capacity(share, (2, 30, 4)) == initialize.MULTI_RANK_GPU_MAX == 2
    assert initialize.nccl_rank_capacity(share, (2, 29, 7)) == 2  # the host-id route too
    # Left set on a machine of 8 GPUs, the switch must not cap it at 2 ranks.
    monkeypatch.setattr(initialize, "gpu_count", lambda: 8)
    assert initialize.nccl_rank_capacity(share, (2, 30, 4)) == 8
    monkeypatch.setattr(initialize, "gpu_count", lambda: 1)
    monkeypatch.setenv(SHARE_GPU_ENV, "1")
    monkeypatch.setattr(initialize, "nccl_version", lambda: (2, 30, 4))
    assert initialize.choose_backend(2, "cuda") == "nccl"
    with pytest.raises(ValueError, match="runs at most 2; use at most 2 ranks or device=cpu"):
        initialize.choose_backend(3, "cuda")
    for version in ((2, 30, 4), (2, 29, 7)):  # whatever the machine's image set
        env = initialize.share_gpu_env(0, version)
        assert {k: env[k] for k in initialize.SOCKETS_ONLY} == {
            "NCCL_NET": "Socket", "NCCL_NET_PLUGIN": "none", "NCCL_COLLNET_ENABLE": "0"}, env


def _fake_torch(cuda=None, init_error=None, devices=1):
    def init():
        if init_error:
            raise RuntimeError(init_error)
    return types.SimpleNamespace(
        __version__="2.13.0" + ("+cpu" if cuda is None else ""),
        version=types.SimpleNamespace(cuda=cuda),
        cuda=types.SimpleNamespace(init=init, device_count=lambda: devices))


@pytest.mark.parametrize("torch_, driver, words", [
    (_fake_torch(), None, ["no CUDA here: torch 2.13.0+cpu is a CPU build", "driver unknown",
                           "driver 580 or newer, the CUDA 13 build: `pip install torch==2.13.0`",
                           "driver 525 to 579, the CUDA 12 build: `pip install torch==2.13.0 "
                           "--index-url https://download.pytorch.org/whl/cu126`"]),
    (_fake_torch("13.0", "The NVIDIA driver on your system is too old (found version 12020)."
                 "\nPlease update"), "535.104.05",
     ["CUDA failed to start: torch 2.13.0 (a CUDA 13.0 build) says: The NVIDIA driver on your "
      "system is too old (found version 12020).;", "driver 535.104.05 runs the CUDA 12 build",
      "--index-url https://download.pytorch.org/whl/cu126`"]),
    (_fake_torch("13.0", devices=0), "580.95.05", ["no CUDA GPU here", "sees none"]),
    (_fake_torch("12.6", "Found no NVIDIA driver on your system"), "470.1",
     ["Found no NVIDIA driver", "driver 470.1 is older than any torch 2.13 build", ">= 525"]),
])
def test_without_a_working_gpu_the_refusal_says_whether_torch_is_a_cpu_build_or_cuda_failed(
        torch_, driver, words):
    line = machine.cuda_problem(torch_, driver)
    assert "\n" not in line and all(w in line for w in words), line
    assert machine.cuda_problem(_fake_torch("13.0"), "580.95.05") is None


def test_the_summary_names_the_torch_build_and_whether_the_driver_runs_it():
    assert machine.build_line(_fake_torch("13.0"), "580.95.05") == \
        "torch 2.13.0 (CUDA 13.0 build; driver 580.95.05, which runs it)"
    line = machine.build_line(_fake_torch("13.0"), "550.54.14")
    assert "driver 550.54.14 runs the CUDA 12 build" in line and "cu126" in line, line
    assert machine.wheel_for("525.60.13")[0] == "12" and machine.wheel_for("520.1") is None


def test_plain_gpu_check_here_refuses_in_one_line_and_a_single_process_gpu_is_refused(
        monkeypatch, capsys):
    import torch
    if not torch.cuda.is_available():  # what this machine really has
        assert gpu_check.main([]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("a CPU build" in err or "CUDA failed" in err), err
    monkeypatch.setattr(machine, "single_process_gpus", lambda: {0: "Exclusive_Process"})
    assert gpu_check.main(["--share-gpu"], gpus=1) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compute mode is Exclusive_Process" in err, err
    assert "nvidia-smi -i 0 -c DEFAULT" in err, err
    # Not only a shared GPU: any GPU the run uses (the suite's pools share every GPU).
    monkeypatch.setattr(machine, "single_process_gpus", lambda: {3: "Prohibited"})
    assert gpu_check.main([], gpus=8) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPU 3's compute mode is Prohibited" in err, err
    assert "nvidia-smi -i 3 -c DEFAULT" in err, err


def test_steps_names_the_steps_to_run_and_an_unknown_one_is_refused(tmp_path, capsys):
    assert gpu_check.main(["--rehearse", "--dry-run", "--steps", "sanitizer,nccl-smoke"]) == 0
    printed = capsys.readouterr().out
    assert [line.split()[0] for line in printed.splitlines()] == ["nccl-smoke", "sanitizer"]
    assert gpu_check.main(["--rehearse", "--dry-run", "--steps", "nccl-test"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nccl-test is not a step" in err and "nccl-tests" in err
    # A time limit for every step, or per step (the others keep their own).
    assert gpu_check.main(["--rehearse", "--dry-run", "--step-timeout", "sanitizer=7"]) == 0
    limits = dict(re.findall(r"^(\S+) \(limit (\S+) s\)", capsys.readouterr().out, re.M))
    assert limits == {name: "7" if name == "sanitizer" else f"{gpu_check.STEP_TIMEOUT_S[name]:g}"
                      for name in limits} and "sanitizer" in limits, limits
    for bad, words in (("0", ["'0'", "positive"]), ("nccl=3", ["'nccl' is not a step",
                                                               "nccl-tests"])):
        assert gpu_check.main(["--rehearse", "--dry-run", "--step-timeout", bad]) == 2
        assert_one_line(capsys.readouterr().err.strip(), words, f"--step-timeout {bad}")


def test_a_k_expression_is_not_taken_for_a_folder_of_that_name(tmp_path, monkeypatch):
    from tensor_parallel_toy.__main__ import path_arguments
    (tmp_path / "nccl").mkdir()
    monkeypatch.chdir(tmp_path)
    assert path_arguments(["-k", "nccl", "--junitxml=r.xml"]) == []
    assert path_arguments(["nccl", "-x"]) == ["nccl"]
