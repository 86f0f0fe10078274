"""The launcher never leaves a rank hanging, never collides on a port, and runs reproducibly.

These tests kill or break their own pools, so they do not use the shared `pools` fixture.
"""
import os
import signal
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tensor_parallel_toy.launcher import initialize
from tensor_parallel_toy.launcher.initialize import choose_backend
from tensor_parallel_toy.launcher.pool import SANITIZER_ENV, WorkerError, WorkerPool
from tensor_parallel_toy.tests.processes import installed_env, process_gone

STOP_WITHIN_S = 30


def _on_rank_fail_while_peers_wait(how):
    """Rank 1 fails; every other rank is already blocked in a collective rank 1 never joins."""
    if dist.get_rank() == 1:
        time.sleep(0.5)  # let the others enter the all-reduce first
        print("a line through Python", file=sys.stderr, flush=True)
        print("not an error: stdout stays where it was", flush=True)
        # As NCCL's watchdog writes before it aborts: the cause, then a native stack trace.
        os.write(2, f"Watchdog caught collective operation timeout, before: {how}\n"
                    f"Exception raised from run at ProcessGroupNCCL.cpp:1\n"
                    f"frame #0: c10::Error::Error + 0x1\nframe #1: clone + 0x44\n".encode())
        if how == "raise":
            raise RuntimeError("boom on purpose")
        if how == "abort":  # what NCCL's watchdog does to a rank whose collective failed
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


@pytest.mark.parametrize("how, first_line", [
    ("raise", "rank 1 raised: RuntimeError: boom on purpose"),
    ("sigkill", "rank 1 died (exit code -9, SIGKILL: the out-of-memory killer's signal"),
    ("abort", "rank 1 died (exit code -6, SIGABRT: an abort, as NCCL's watchdog aborts a rank"),
])
def test_a_failing_rank_stops_all_ranks_and_is_named_with_its_cause_first(how, first_line,
                                                                         tmp_path):
    pool = WorkerPool(3, log_dir=str(tmp_path))
    procs = list(pool._procs)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pool.run(_on_rank_fail_while_peers_wait, how)
    elapsed = time.monotonic() - start
    assert elapsed < STOP_WITHIN_S, f"took {elapsed:.1f} s to notice and stop the ranks"
    message = str(info.value)
    assert message.splitlines()[0].startswith(first_line), message  # pytest's one-line summary
    # What the rank said reaches the error, under pytest's capture too: the line that says why
    # in the first line when it died (it had no traceback to send), its last lines but the
    # stack frames after them either way.
    said = f"Watchdog caught collective operation timeout, before: {how}"
    assert (f"its last words: {said}" in message.splitlines()[0]) == (how != "raise"), message
    assert message.endswith(f"  a line through Python\n  {said}"), message
    with open(tmp_path / "rank1-of-3.log") as f:
        assert f.read().endswith(f"{said}\nException raised from run at ProcessGroupNCCL.cpp:1\n"
                                 f"frame #0: c10::Error::Error + 0x1\nframe #1: clone + 0x44\n")
    for proc in procs:
        proc.join(timeout=5)
    alive = [p.name for p in procs if p.is_alive()]
    assert not alive, f"ranks still running after the failure: {alive}"
    assert not pool.alive


def _on_rank_train(steps):
    """A few steps of the TP model on fixed data; returns the losses as exact bit patterns."""
    from tensor_parallel_toy import ModelConfig, Transformer

    config = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                         ffn_hidden_size=32, max_seq_len=8)
    model = Transformer(config, tp_group=dist.group.WORLD, overlap=True, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (2, 8), generator=gen)
    losses = []
    for _ in range(steps):
        loss = model.loss(ids, ids.roll(-1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    return losses, dist.get_world_size()


def test_two_runs_at_once_pick_their_own_ports_and_give_bitwise_identical_losses():
    first, second = WorkerPool(2), WorkerPool(2)  # both alive at the same time
    try:
        assert first._store.port != second._store.port
        a, b = first.run(_on_rank_train, 4), second.run(_on_rank_train, 4)
    finally:
        first.close(), second.close()
    assert a[0][1] == b[0][1] == 2
    losses_a, losses_b = [r[0] for r in a], [r[0] for r in b]
    assert all(l == losses_a[0] for l in losses_a), f"ranks disagree: {losses_a}"
    assert losses_a == losses_b, f"run 1: {losses_a[0]}\nrun 2: {losses_b[0]}"
    assert len(set(losses_a[0])) > 1, "the loss did not change: the test would prove nothing"


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=0), ["world size 0", "positive"]),
    (dict(world_size=2, backend="mpi"), ["backend 'mpi'", "gloo, nccl"]),
])
def test_bad_launcher_arguments_fail_before_spawning(kwargs, words):
    with pytest.raises(ValueError) as info:
        WorkerPool(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_device_requests_are_refused_with_what_is_valid(monkeypatch):
    monkeypatch.delenv(initialize.SHARE_GPU_ENV, raising=False)  # sharing would lift the limit
    with pytest.raises(ValueError, match="device 'tpu' is not one of: auto, cpu, cuda"):
        choose_backend(2, "tpu")
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match="no CUDA GPU is available"):
            choose_backend(2, "cuda")
    gpus = torch.cuda.device_count()
    if gpus:
        with pytest.raises(ValueError, match=f"found {gpus}"):
            choose_backend(gpus + 1, "cuda")
    assert choose_backend(64, "auto") == ("gloo" if gpus < 64 else "nccl")


def test_ranks_share_one_gpu_only_when_asked_each_claiming_its_own_nccl_host(monkeypatch):
    monkeypatch.delenv(initialize.SHARE_GPU_ENV, raising=False)  # "not asked", whoever runs it
    monkeypatch.setattr(initialize, "gpu_count", lambda: 1)
    assert initialize.nccl_rank_capacity(env={}) == 1
    # At most two ranks on the GPU on either route: more were never run.
    assert initialize.nccl_rank_capacity({initialize.SHARE_GPU_ENV: "1"}, (2, 29, 7)) == 2
    with pytest.raises(ValueError, match=initialize.SHARE_GPU_ENV):
        choose_backend(2, "cuda")  # one GPU, two ranks, not asked to share: refused, and why
    monkeypatch.setenv(initialize.SHARE_GPU_ENV, "1")
    assert choose_backend(2, "cuda") == choose_backend(2, "auto") == "nccl"
    hosts = {initialize.share_gpu_env(rank, (2, 27, 3))["NCCL_HOSTID"] for rank in range(4)}
    assert len(hosts) == 4, hosts  # the same host id on two ranks: "Duplicate GPU detected"
    monkeypatch.setattr(initialize, "gpu_count", lambda: 0)
    assert initialize.nccl_rank_capacity() == 0  # sharing needs a GPU to share


def test_nccl_streams_keep_torch_default_priority_unless_asked():
    assert initialize.nccl_options(False) is None
    if hasattr(torch.distributed, "ProcessGroupNCCL"):  # a CUDA build of torch
        assert initialize.nccl_options(True).is_high_priority_stream


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_2(capsys, monkeypatch):
    from tensor_parallel_toy.launcher import gpu_check
    monkeypatch.delenv(initialize.SHARE_GPU_ENV, raising=False)  # it would allow one GPU
    monkeypatch.setattr(gpu_check.machine, "cuda_problem", lambda: None)  # CUDA started, 0 GPUs
    for gpus, flags, words in [(0, [], ["no CUDA GPU here"]),
                               (1, [], ["1 CUDA GPU", "--share-gpu", initialize.SHARE_GPU_ENV])]:
        assert gpu_check.main(flags, gpus=gpus) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(w in err for w in words), err


def test_gpu_check_plan_runs_the_nccl_tests_sanitizer_profile_and_large_benchmark(tmp_path):
    from tensor_parallel_toy.launcher import gpu_check
    from tensor_parallel_toy.profiling import cli
    out = str(tmp_path)
    steps = {s.name: s for s in gpu_check.plan(2, False, out)}
    assert list(steps) == ["nccl-smoke", "nccl-tests", "sanitizer", "profile",
                           "large-overlap"], list(steps)
    assert steps["nccl-smoke"].argv[2:5] == ["tensor_parallel_toy.launcher.smoke", "--device",
                                             "cuda"]
    assert steps["sanitizer"].env["TORCH_CUDA_SANITIZER"] == "1"
    assert steps["nccl-tests"].argv[4:6] == ["-k", "nccl"]
    for name in ("profile", "large-overlap"):  # the flags parse (without --device cuda here)
        argv = steps[name].argv[3:]
        assert argv[:3] == ["profile", "--device", "cuda"], argv
        args = cli.parse_args(argv[3:], env={})
        assert args.device == "auto", name
    assert steps["large-overlap"].results == os.path.join(out, "large-overlap")
    # Two ranks time-slicing one GPU; the smoke step: its ranks' start and timeout, and more.
    assert all(s.timeout_s >= 1200 for s in steps.values() if s.name != "nccl-smoke")
    assert steps["nccl-smoke"].timeout_s > 2 * gpu_check.SMOKE_TIMEOUT_S + 30
    shared = {s.name: s for s in gpu_check.plan(1, True, out)}
    assert "large-overlap" not in shared  # two ranks on one GPU: no timings worth keeping
    assert all(s.env.get(initialize.SHARE_GPU_ENV) == "1" for s in shared.values())


# ----------------------------------------------------------------------------------------------
# Joining a process group from the environment (torchrun, or RANK/WORLD_SIZE/MASTER_* by hand)
# ----------------------------------------------------------------------------------------------
TWO_HOSTS = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2",
             "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, addresses, problem", [
    (TWO_HOSTS, ["127.0.1.1"], True),
    (TWO_HOSTS, ["127.0.0.1", "::1"], True),
    (TWO_HOSTS, ["10.1.2.3"], False),  # a real address: gloo advertises it, fine
    ({**TWO_HOSTS, "GLOO_SOCKET_IFNAME": "eth0"}, ["127.0.1.1"], False),  # the user chose
    ({**TWO_HOSTS, "MASTER_ADDR": "127.0.0.1"}, ["127.0.1.1"], False),  # all on one machine
    ({**TWO_HOSTS, "LOCAL_WORLD_SIZE": "4"}, ["127.0.1.1"], False),  # one host
])
def test_multi_host_gloo_with_a_loopback_host_name_is_named_before_connecting(env, addresses,
                                                                              problem):
    message = initialize.gloo_loopback_problem(env, "vm", addresses)
    if not problem:
        assert message is None, message
        return
    for words in ("2 hosts", "'vm' resolves to " + addresses[0], "GLOO_SOCKET_IFNAME",
                  "MASTER_ADDR=node0"):
        assert words in message, message


# In the child: this host's name resolves to loopback only, whatever /etc/hosts says here.
_LOOPBACK_HOST = ("import socket, sys; real = socket.getaddrinfo; socket.getaddrinfo = "
                  "lambda host, *a, **k: [(2, 1, 6, '', ('127.0.1.1', 0))] "
                  "if host == socket.gethostname() else real(host, *a, **k); "
                  "from tensor_parallel_toy.__main__ import main; sys.exit(main(sys.argv[1:]))")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_failures(folder):
    """Three ways a job fails to form, as real commands: {name: (argv, env, words)}."""
    base = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "GLOO_SOCKET_IFNAME")}
    profile = ["profile", "--out", os.path.join(folder, "launch-out"), "--timeout", "3"]
    port = str(_free_port())
    runs = {
        "loopback host": ([sys.executable, "-c", _LOOPBACK_HOST, *profile],
                          {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                           "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
                           "MASTER_PORT": port},
                          ["this gloo job spans 2 hosts", "resolves to 127.0.1.1",
                           "set GLOO_SOCKET_IFNAME", "MASTER_ADDR=node0"]),
        "nobody listening": ([sys.executable, "-m", "tensor_parallel_toy", *profile],
                             {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": port},
                             [f"nothing answers at MASTER_ADDR=127.0.0.1 MASTER_PORT={port}",
                              "after 3 s"]),
        "torchrun, bad interface": ([sys.executable, "-m", "torch.distributed.run",
                                     "--standalone", "--nproc-per-node=2", "-m",
                                     "tensor_parallel_toy", *profile],
                                    {"GLOO_SOCKET_IFNAME": "no-such-if"},
                                    ["could not form the gloo process group at MASTER_ADDR=",
                                     "Unable to find address for: no-such-if",
                                     "GLOO_SOCKET_IFNAME=no-such-if (interfaces here: lo"]),
    }
    return {name: (argv, {**base, **env}, words) for name, (argv, env, words) in runs.items()}


# Started with the session (conftest.py); the words each one's line must hold are kept here.
LAUNCH_FAILURES = {}


def _background_launch_failure(name):
    def start(folder):
        if not LAUNCH_FAILURES:
            LAUNCH_FAILURES.update(_launch_failures(folder))
        argv, env, _ = LAUNCH_FAILURES[name]
        return dict(argv=argv, env=env)
    return start


LAUNCH_NAMES = ("loopback host", "nobody listening", "torchrun, bad interface")
BACKGROUND = {name: _background_launch_failure(name) for name in LAUNCH_NAMES}


@pytest.mark.background(*LAUNCH_NAMES)
def test_launch_failures_are_one_line_exit_2_no_traceback_under_torchrun_too(background):
    """Three ways a job fails to form, started together (each imports torch: seconds):
    a multi-host gloo job on a host whose name is loopback; a rank whose MASTER_ADDR has
    nothing listening (short --timeout); and torchrun's ranks with a GLOO_SOCKET_IFNAME that
    does not exist (torchrun adds its own report of the failed ranks after their lines)."""
    assert sorted(LAUNCH_FAILURES) == sorted(LAUNCH_NAMES), LAUNCH_FAILURES
    for name, (_, _, words) in LAUNCH_FAILURES.items():
        code, _, err = background.result(name, timeout=120)
        ours = [line for line in err.splitlines() if line.startswith(
            "python -m tensor_parallel_toy profile: error: ")]
        ranks = 2 if "torchrun" in name else 1  # torchrun stops a rank once its peer failed
        assert 1 <= len(ours) <= ranks, f"{name}: exit {code}, stderr:\n{err[-3000:]}"
        for line in ours:
            assert all(w in line for w in words), f"{name}: {line}"
        # No frame of this package: the traceback torchrun prints is its own launcher's.
        rest = "\n".join(line for line in err.splitlines() if line not in ours)
        assert "tensor_parallel_toy/" not in rest, f"{name}:\n{err[-3000:]}"
        if "torchrun" not in name:
            assert code == 2 and err.strip() == ours[0], f"{name}:\n{err[-3000:]}"
        else:
            assert code != 0 and "exitcode  : 2" in err, f"{name}:\n{err[-3000:]}"


_POOL_THEN_WAIT = ("import os, sys, time\n"
                   "from tensor_parallel_toy.launcher.pool import WorkerPool\n"
                   "if __name__ == '__main__':\n"
                   "    pool = WorkerPool(2)\n"
                   "    print(' '.join(str(p.pid) for p in pool._procs), flush=True)\n"
                   "    time.sleep(600)\n")


def _script_command(name, text, **env):
    """A background command (conftest.py) running `text` as the script `name` in its folder,
    the package installed, `env` added to the environment."""
    def start(folder):
        script = os.path.join(folder, name)
        with open(script, "w") as f:
            f.write(text)
        return dict(argv=[sys.executable, script], env={**installed_env(), **env})
    return start


BACKGROUND["killed launcher"] = _script_command("launcher.py", _POOL_THEN_WAIT)


@pytest.mark.background("killed launcher")
def test_a_killed_launchers_workers_exit_within_seconds(background):
    """SIGKILL gives the launcher no chance to stop its workers: they notice by themselves (their
    parent, the launcher or the fork server that ends with it, is gone). The launcher started
    with the session and has waited since."""
    try:
        workers = [int(pid) for pid in background.first_line("killed launcher").split()]
    finally:
        background.kill("killed launcher")
    assert len(workers) == 2, workers
    deadline = time.monotonic() + STOP_WITHIN_S
    while time.monotonic() < deadline and not all(process_gone(p) for p in workers):
        time.sleep(0.2)
    alive = [p for p in workers if not process_gone(p)]
    assert not alive, f"workers {alive} outlived their killed launcher"


# ----------------------------------------------------------------------------------------------
# The fork server starts clean
# ----------------------------------------------------------------------------------------------
def _on_rank_sanitizer_state():
    """What this worker inherited from the fork server, after a tensor op of its own."""
    import torch.cuda._sanitizer as csan

    total = float(torch.ones(3).sum())  # the sanitizer, if on, touches CUDA at every op
    return {"sanitizer on": bool(csan.cuda_sanitizer.enabled),
            "cuda initialised": torch.cuda.is_initialized(), "sum": total}


_POOL_WITH_SANITIZER = (
    "import json\n"
    "from tensor_parallel_toy.launcher.pool import WorkerPool\n"
    "from tensor_parallel_toy.tests.test_launcher import _on_rank_sanitizer_state\n"
    "if __name__ == '__main__':\n"
    "    with WorkerPool(2) as pool:\n"
    "        print(json.dumps(pool.run(_on_rank_sanitizer_state)), flush=True)\n")


BACKGROUND["sanitizer in the environment"] = _script_command(
    "sanitized_launcher.py", _POOL_WITH_SANITIZER, **{SANITIZER_ENV: "1"})


@pytest.mark.background("sanitizer in the environment")
def test_the_fork_server_imports_torch_without_the_cuda_sanitizer(background):
    """TORCH_CUDA_SANITIZER in the launcher's environment (gpu-check's sanitizer step sets it)
    must not reach the fork server: there the sanitizer would touch CUDA at its first tensor
    op, and every worker forked from it would fail ("Cannot re-initialize CUDA in forked
    subprocess" on a GPU; on this CPU build, "Torch not compiled with CUDA enabled"). A worker
    turns it on itself, where CUDA is (not here)."""
    code, out, err = background.result("sanitizer in the environment", timeout=120)
    assert code == 0, out + err[-3000:]
    import json
    states = json.loads(out.strip().splitlines()[-1])
    assert states == [{"sanitizer on": False, "cuda initialised": False, "sum": 3.0}] * 2, states
