"""`profile --link`: the emulated multi-host link (profiling/wires/link.py).

Flag errors and refusals need nothing special. The runs over the link need Linux, root, `ip`
and `tc` (CI runs as root) and are skipped with the reason otherwise; each checks afterwards
that no namespace of ours is left, whatever happened.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from tensor_parallel_toy.profiling import cli as profile
from tensor_parallel_toy.profiling.run import phases
from tensor_parallel_toy.profiling.wires import link, link_sweep

TINY = ["--steps", "3", "--warmup", "1", "--batch", "2", "--seq", "16", "--hidden", "32",
        "--heads", "4", "--ffn", "64", "--layers", "1", "--bench-iters", "0",
        "--timeline-iters", "0", "--modes", "baseline,tp,tp_overlap"]


def _why_no_link():
    try:
        link.check_host()
    except link.LinkUnavailable as e:
        return str(e)
    return None


NO_LINK = _why_no_link()
needs_link = pytest.mark.skipif(NO_LINK is not None, reason=f"no emulated link here: {NO_LINK}")


def _namespaces_of(pid):
    return sorted(n for n, p in link.our_namespaces().items() if p == pid)


def _wait_for(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.background("bad rate")
def test_a_bad_rate_as_a_real_command_is_one_line_and_exit_status_2(background):
    pid = background.pid("bad rate")
    code, _, err = background.result("bad rate", timeout=120)
    err = err.strip()
    assert code == 2, (code, err)
    assert "\n" not in err and "Traceback" not in err, err
    assert "--link '4gb'" in err and "4gbit" in err, err
    assert not _namespaces_of(pid), "a bad flag built something"


@pytest.mark.parametrize("value", ["4gbit:5ms", "0gbit", "fast", "4 gbit/s", "4Gbps"])
def test_a_bad_rate_is_one_line_naming_it_and_the_valid_forms(value, capsys, tmp_path):
    code = profile.main(["--link", value, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--link {value!r}" in err and "4gbit" in err and "mbit" in err, err
    if ":" in value:
        assert "netem" in err, err


@pytest.mark.parametrize("flags, env, words", [
    (["--device", "cuda"], {}, ["--link", "--device cuda"]),
    ([], {"RANK": "0", "WORLD_SIZE": "2"}, ["--link", "not under torchrun"]),
])
def test_link_refuses_torchrun_and_cuda(flags, env, words, tmp_path):
    with pytest.raises(profile.UsageError) as info:
        profile.parse_args(["--link", "4gbit", *flags, "--out", str(tmp_path)], env=env)
    assert all(w in str(info.value) for w in words), info.value


@pytest.mark.parametrize("host, words", [
    ({"geteuid": lambda: 1000}, ["must run as root"]),
    ({"which": lambda tool: None}, ["ip and tc", "not found"]),
    ({"platform": "darwin"}, ["Linux", "darwin"]),
])
def test_without_root_ip_tc_or_linux_it_refuses_in_one_line_before_anything_starts(
        host, words, monkeypatch, capsys, tmp_path):
    if "geteuid" in host:
        monkeypatch.setattr(link.os, "geteuid", host["geteuid"])
    if "which" in host:
        monkeypatch.setattr(link.shutil, "which", host["which"])
    if "platform" in host:
        monkeypatch.setattr(link.sys, "platform", host["platform"])
    started = []
    monkeypatch.setattr(link.EmulatedLink, "__enter__", lambda self: started.append(self))
    code = profile.main(["--link", "4gbit", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, f"exit status {code}: {err}"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    assert not started, "the link was built although the host cannot have one"


@needs_link
def test_a_kernel_without_tbf_is_refused_in_one_line_and_nothing_is_left(monkeypatch, capsys,
                                                                         tmp_path):
    run = link._run

    def no_tbf(*cmd):
        if cmd[0] == "tc":
            raise RuntimeError(f"{' '.join(cmd)}: Error: Specified qdisc kind is unknown.")
        return run(*cmd)
    monkeypatch.setattr(link, "_run", no_tbf)
    code = profile.main(["--link", "4gbit", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and "qdisc kind is unknown" in err, err
    assert not _namespaces_of(os.getpid()), link.our_namespaces()


def test_link_flag_is_removed_in_every_form_argparse_accepts():
    for given in (["--link", "4gbit"], ["--link=4gbit"], ["--lin", "4gbit"], ["--li=4gbit"]):
        argv = link.argv_for_ranks(["--steps", "5", *given, "--layers", "1"], threads=3)
        assert argv == ["--steps", "5", "--layers", "1", "--device", "cpu", "--threads", "3"], \
            (given, argv)


def _link_command(out, *argv):
    """`python -m ARGV --out FOLDER/OUT`, a real command over the link, run beside the
    in-process tests (conftest.py): mostly waiting for the shaped wire. Where no link can be
    made, a command that does nothing (its test skips)."""
    def start(folder):
        if NO_LINK is not None:
            return dict(argv=[sys.executable, "-c", "pass"])
        return dict(argv=[sys.executable, "-m", *argv, "--out", os.path.join(folder, out)])
    return start


BACKGROUND = {
    "bad rate": lambda folder: dict(argv=[sys.executable, "-m", "tensor_parallel_toy", "profile",
                                          "--link", "4gb", "--out", folder]),
    "profile over the link": _link_command("link-profile", "tensor_parallel_toy", "profile",
                                           *TINY, "--link", "4gbit"),
    "decode over the link": _link_command(
        "link-decode", "tensor_parallel_toy.profiling.run.decode", "--hidden", "64", "--layers",
        "1", "--batches", "1", "--tokens", "3", "--repeats", "1", "--prompt", "4", "--link",
        "1gbit"),
}


@needs_link
@pytest.mark.background("profile over the link")
def test_two_ranks_over_the_link_train_exactly_as_over_loopback(pools, tmp_path, background):
    """Same flags, same losses to the last bit: the link changes the timing, not the numbers.
    The link run is the real command (namespaces, tbf, one torchrun-style rank per namespace);
    the loopback run is the local pool."""
    pid = background.pid("profile over the link")
    code, stdout, stderr = background.result("profile over the link", timeout=180)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    out = pathlib.Path(background.folder) / "link-profile"
    assert not _namespaces_of(pid), "namespaces left after a successful run"
    saved = json.loads((out / "results.json").read_text())
    meta = saved["meta"]
    assert meta["link"]["rate"] == "4gbit" and meta["link"]["topology"] == "veth pair", meta
    assert meta["link"]["measured_bits_per_s"] > 0, meta["link"]
    assert "link: 4gbit" in (out / "summary.txt").read_text()

    args = profile.parse_args([*TINY, "--out", str(tmp_path / "loopback")], env={})
    args.argv = TINY
    # Each step's bytes on the wire, read from the interface: at least what the shapes say the
    # ring sends. At this tiny size the step's small collectives (barrier, batch check, loss
    # and norm all-reduces) and the headers add ~20 KB to 30 KB (at the profile's sizes, +5 %).
    derived = link_sweep.bytes_per_step(args.config, args.batch, args.seq, args.tp, args.dtype)
    sent = saved["modes"]["tp_overlap"]["sent_bytes_per_step"]
    assert derived <= sent <= 2 * derived, f"sent {sent} B per step, derived {derived} B"
    loopback = phases.run_phases(phases.PoolRunner(pools(2)), args)
    for mode in ("baseline", "tp", "tp_overlap"):
        over_link, over_loopback = saved["modes"][mode]["loss"], loopback["modes"][mode]["loss"]
        assert over_link == over_loopback, f"{mode}: link {over_link} vs loopback {over_loopback}"


def _rank_pids(namespace):
    """The profile's rank processes in `namespace` (not the link's throughput probe)."""
    pids = []
    for pid in link.namespace_pids(namespace):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tensor_parallel_toy" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


def _start_link_run(tmp_path):
    """The real command, long enough to be killed mid-run; returns it once both ranks run."""
    proc = subprocess.Popen([sys.executable, "-m", "tensor_parallel_toy", "profile", *TINY,
                             "--steps", "1000", "--link", "4gbit", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    names = [f"{link.PREFIX}-{proc.pid}-r{r}" for r in range(2)]

    def ranks_running():
        assert proc.poll() is None, proc.communicate()
        return all(_namespaces_of(proc.pid) == names and _rank_pids(n) for n in names)
    _wait_for(ranks_running, 60, "both ranks to start in their namespaces")
    return proc, names


@needs_link
def test_a_dead_rank_stops_the_other_and_the_link_is_removed(tmp_path, capfd):
    """The launcher runs here; a thread SIGKILLs rank 1 as soon as it has started."""
    names = [f"{link.PREFIX}-{os.getpid()}-r{r}" for r in range(2)]
    ranks = {}

    def kill_rank_1():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_rank_pids(n) for n in names):
            time.sleep(0.05)
        ranks.update({n: _rank_pids(n) for n in names})
        if ranks[names[1]]:
            os.kill(ranks[names[1]][0], signal.SIGKILL)
    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    try:
        code = profile.main([*TINY, "--steps", "1000", "--link", "4gbit", "--out",
                             str(tmp_path)])
    finally:
        killer.join(timeout=60)
        link.remove_namespaces(_namespaces_of(os.getpid()))
    err = capfd.readouterr().err
    assert ranks.get(names[1]), f"rank 1 never started: {err[-2000:]}"
    assert code == 1, (code, err[-2000:])
    last = err.strip().splitlines()[-1]  # the ranks' own output comes before it
    assert last == "python -m tensor_parallel_toy profile: error: rank 1 was killed by " \
                   "signal 9; stopped the other ranks", err[-2000:]
    assert not _namespaces_of(os.getpid()), "namespaces left after a rank died"
    alive = [pid for pid in ranks[names[0]] if os.path.exists(f"/proc/{pid}")]
    assert not alive, f"rank 0 (pids {alive}) still runs"


@needs_link
def test_a_killed_launcher_leaves_namespaces_that_the_next_start_removes(tmp_path):
    proc, names = _start_link_run(tmp_path)
    ranks = [pid for n in names for pid in _rank_pids(n)]
    try:
        proc.kill()  # SIGKILL: no chance to clean up
        proc.communicate(timeout=20)
        assert _namespaces_of(proc.pid) == names, "a SIGKILLed launcher cannot remove them"
        _wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in ranks), 10,
                  f"the ranks {ranks} to die with their launcher")
        removed = link.remove_leftovers()  # what every start of --link does first
    finally:
        link.remove_namespaces(_namespaces_of(proc.pid))
    assert set(names) <= set(removed), removed
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names), listed


def test_several_rates_are_a_sweep_in_increasing_rate(tmp_path):
    args = profile.parse_args(["--link", "8gbit,1GBIT, 500mbit,4gbit,1gbit", "--out",
                               str(tmp_path)], env={})
    assert args.link_rates == [(5e8, "500mbit"), (1e9, "1gbit"), (4e9, "4gbit"), (8e9, "8gbit")], \
        args.link_rates
    single = profile.parse_args(["--link", "2.5gbit", "--out", str(tmp_path)], env={})
    assert single.link_rates == [(2.5e9, "2.5gbit")], single.link_rates


@pytest.mark.parametrize("value, words", [
    ("1gbit,,4gbit", ["--link '1gbit,,4gbit'", "empty rate"]),
    ("1gbit,2x", ["--link '2x'", "4gbit"]),
    ("1gbit,4gbit:1ms", ["--link '4gbit:1ms'", "netem"]),
])
def test_a_bad_rate_in_a_sweep_is_named(value, words, tmp_path):
    with pytest.raises(profile.UsageError) as info:
        profile.parse_args(["--link", value, "--out", str(tmp_path)], env={})
    assert all(w in str(info.value) for w in words), info.value


@needs_link
@pytest.mark.background("decode over the link")
def test_the_decode_measurement_runs_over_the_link_one_rank_per_namespace(background):
    """`profiling/run/decode.py --link`: the real command, each rank the torchrun path of it in
    its namespace; rank 0 writes the summary, which names the link, and nothing is left."""
    pid = background.pid("decode over the link")
    code, stdout, stderr = background.result("decode over the link", timeout=180)
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    out = pathlib.Path(background.folder) / "link-decode"
    results = json.loads((out / "decode.json").read_text())
    assert results["link"]["rate"] == "1gbit" and results["link"]["measured_bits_per_s"] > 0
    assert results["modes"]["tp/b1"]["transfers_per_token"] == 1 + 2 * 1 + 2, results["modes"]
    summary = (out / "summary.txt").read_text()
    assert "over a shaped veth link of 1gbit" in summary and stdout.count(summary) == 1
    assert not _namespaces_of(pid), "namespaces left after the run"
