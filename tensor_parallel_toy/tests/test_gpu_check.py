"""gpu-check runs on CPU exactly as it will on a GPU: the rehearsal takes every step through the
same subprocesses, time limits, result files and summary; a step past its limit is stopped with
everything it started; one GPU needs the sharing switch, given by flag or variable alike.
"""
import sys
import time

import pytest

from tensor_parallel_toy.launcher import gpu_check, initialize
from tensor_parallel_toy.launcher.gpu_check import Step, run_step, summary
from tensor_parallel_toy.launcher.initialize import SHARE_GPU_ENV

REHEARSED = ["nccl-tests", "sanitizer", "profile"]  # one GPU: large-overlap is skipped


def test_rehearsal_runs_every_step_on_cpu_and_its_summary_says_what_passed(tmp_path,
                                                                            monkeypatch, capsys):
    """The one-GPU plan (the machine most likely to turn up), its test steps narrowed to a few
    tests that start no ranks (the suite runs the rest); the profile at the rehearsal's size."""
    monkeypatch.delenv(SHARE_GPU_ENV, raising=False)  # --share-gpu must set it for the steps
    out = tmp_path / "gpu"
    code = gpu_check.main(["--rehearse", "--share-gpu", "--out", str(out), "--tests",
                           "multi_host_gloo and loopback"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-4000:]
    block = (out / "summary.txt").read_text()
    first = block.splitlines()[0]
    assert first == (f"{gpu_check.PROG} --rehearse: 3 of 3 steps passed; results in {out}/ "
                     f"(summary.txt, a .log per step)"), block
    assert printed.endswith(block), printed[-2000:]
    for name in REHEARSED:
        assert f"\n=== {name}: passed" in printed, printed[-4000:]
        assert (out / f"{name}.log").stat().st_size > 0, name
    lines = {line.split()[1]: line for line in block.splitlines()[1:] if line.startswith("  ")}
    for name in ("nccl-tests", "sanitizer"):  # each ran the selected tests, and said so
        assert lines[name].split()[0] == "passed" and "6 passed" in lines[name], block
        assert (out / f"{name}.xml").exists(), name
    assert (out / "profile" / "results.json").exists() and "results in" in lines["profile"]
    assert lines["large-overlap"].split()[0] == "skipped", block
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1 where NCCL >= 2.30" in block, block
    assert "correctness, not speed" in block, block


def test_rehearsal_takes_the_gpu_runs_steps_with_only_backend_device_and_sizes_changed(tmp_path):
    out = str(tmp_path)
    for gpus in (1, 2):
        real = gpu_check.plan(gpus, True, out)
        rehearsal = gpu_check.plan(gpus, True, out, rehearse=True)
        assert [s.name for s in rehearsal] == [s.name for s in real]
        for r, g in zip(rehearsal, real):
            assert (r.timeout_s, r.results, r.report) == (g.timeout_s, g.results, g.report)
            assert r.argv[:4] == g.argv[:4], (r.argv, g.argv)  # python -m package test|profile
            assert {**r.env, "TORCH_CUDA_SANITIZER": "1"} == {**g.env, "TORCH_CUDA_SANITIZER":
                                                              "1"}, r.name
            if g.report:  # the gloo twin of each NCCL test
                assert r.argv[5] == g.argv[5].replace("nccl", "gloo"), (r.argv, g.argv)
            else:
                assert r.argv[4:6] == ["--device", "cpu"] and g.argv[4:6] == ["--device", "cuda"]
    narrowed = [s for s in gpu_check.plan(1, True, out, tests="ring_buffers") if s.report]
    assert [s.argv[5] for s in narrowed] == ["nccl and (ring_buffers)"] * 2, narrowed


def _sleeper(tmp_path):
    """A step that starts a child and then waits for ever, as a hung test step would with its
    ranks; writes the child's pid."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); "
            "print('started', flush=True); time.sleep(600)")
    return Step("sleeper", [sys.executable, "-c", code], {}, "sleeps", timeout_s=600), pid_file


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")  # dead, not yet reaped
    except FileNotFoundError:
        return True


def test_a_step_past_its_time_limit_is_stopped_with_its_children_and_reported(tmp_path, capsys):
    step, pid_file = _sleeper(tmp_path)
    start = time.monotonic()
    outcome = run_step(step, str(tmp_path), timeout_s=2)
    assert time.monotonic() - start < 20, "the step was not stopped at its limit"
    assert outcome.status == "TIMED OUT" and "stopped after 2 s" in outcome.detail, outcome
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), f"the step's child {child} outlived it"
    assert "started" in (tmp_path / "sleeper.log").read_text()
    assert "started" in capsys.readouterr().out  # on the screen too, as it came
    first = summary([outcome], str(tmp_path)).splitlines()[0]
    assert "0 of 1 steps passed; TIMED OUT: sleeper; results in" in first, first


def test_a_failed_step_puts_its_failing_tests_in_the_summary_and_a_step_that_ran_nothing_fails(
        tmp_path):
    failing = Step("nccl-tests", [sys.executable, "-c", "print('....F'); print('FAILED t.py::"
                                  "test_ring[nccl] - AssertionError: y=1.3'); raise SystemExit(1)"],
                   {}, "fails")
    skipped_all = Step("sanitizer", [sys.executable, "-c", "pass"], {}, "skips",
                       report=str(tmp_path / "skipped.xml"))
    (tmp_path / "skipped.xml").write_text(
        '<testsuites><testsuite tests="4" failures="0" errors="0" skipped="4"/></testsuites>')
    outcomes = [run_step(failing, str(tmp_path)), run_step(skipped_all, str(tmp_path))]
    block = summary(outcomes, str(tmp_path))
    assert block.splitlines()[0].startswith(
        f"{gpu_check.PROG}: 0 of 2 steps passed; FAILED: nccl-tests, sanitizer; results in"), block
    assert "| FAILED t.py::test_ring[nccl] - AssertionError: y=1.3" in block, block
    assert "no test ran, 4 skipped" in block, block


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
    assert by_flag.count(f"{SHARE_GPU_ENV}=1 ") == 3 and "large-overlap" not in by_flag, by_flag
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
        assert env == [{initialize.MULTI_RANK_GPU_ENV: "1"}] * 3, env
    else:  # the same host id on two ranks: "Duplicate GPU detected"
        assert len({e["NCCL_HOSTID"] for e in env}) == 3, env
        assert all(initialize.MULTI_RANK_GPU_ENV not in e for e in env), env
    route = initialize.share_gpu_route(version)
    assert route.startswith("through ") and all(w in route for w in words), route

