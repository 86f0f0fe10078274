"""`python -m tensor_parallel_toy gpu-check`: everything this package claims about GPUs, run on
the GPUs of this machine, in one command. This file plans and runs the steps; gpu_report.py
reads what they wrote into the summary.

Steps, each its own process, in order:
0. nccl-smoke: two ranks form an NCCL group, all-reduce, take one ring step and meet at a barrier
   (launcher/smoke.py), within minutes. If it fails, its line names the cause (the rank's own
   error, an abort, or the ranks that never answered) and the run stops there: every later step
   starts its ranks the same way.
1. nccl-tests: the suite's NCCL variants (the layers on multi-MB transfers, strided inputs,
   subgroups, bf16, the whole model, the profile's phases with every collective checked for
   its device, and the ring-buffer tests below); `pytest -k nccl`.
2. sanitizer: the overlapped layers' NCCL tests again under TORCH_CUDA_SANITIZER=1, PyTorch's
   CUDA stream sanitizer (https://pytorch.org/docs/stable/cuda._sanitizer.html). What it sees:
   the kernels PyTorch launches on its own streams and the tensors each reads and writes; it
   reports a kernel that uses a tensor another PyTorch stream may still be using. What it does
   not see: NCCL's internal stream. A c10d send, receive or collective is at most recorded as
   an access on the stream that was current when it was posted, not on the stream where NCCL
   moves the bytes, so a ring that writes a buffer again before its transfer's `wait()` (or
   drops the wait) looks correct to it: it cannot catch ring-buffer reuse by itself. The tests
   that can are in step 1: tests/test_ring_buffers.py makes every transfer land at once or
   only at its `wait()`, checks the overlapped layers against F.linear both ways, and checks
   that the same layer check fails for three broken rings (a dropped wait, a send buffer
   written before its wait, a receive into the buffer still in use).
3. profile: a short default profile on NCCL (every phase, all modes).
4. large-overlap: the overlap benchmark at a shape where GEMMs and transfers take milliseconds
   (s=8192, b=1, h=4096, m=16384, bf16), with tp and tp_overlap trained beside it: the numbers
   a post about GPUs would quote.

Each step has a time limit generous enough for two ranks time-slicing one GPU (`--step-timeout`
overrides it, for every step or per step); a step past it is stopped, with every rank it
started, and reported as timed out. Each step's output goes to the screen and to OUT/<step>.log
(the test steps also write OUT/<step>.xml, pytest's JUnit report; both, and a profile's
results.json, are removed before the step starts, so nothing stale is read). Each rank's own
stderr (NCCL's warnings, a watchdog's last words) goes to OUT/<step>-ranks/rank<r>-of-<n>.log,
whatever pytest captures; a rank that dies is named with its last words (the line that says why)
and its last lines follow, and a failed step's summary names the folder. The summary, printed
last and written to OUT/summary.txt, is the block to paste back. Its first line says what
passed, what failed and where the results are; the failed steps come next, each followed by its
failed tests and their causes (from the JUnit report: the exception's first line, which for a
rank's error carries that rank's own), then the rest. A test step in which no test of its
backend (`[nccl]`) passed has failed, whatever else passed.

Ranks share one GPU with `--share-gpu` or TENSOR_PARALLEL_TOY_SHARE_GPU=1 (the same switch: the
flag sets the variable for every step). With one GPU one of them is required; two ranks then
run on it, through NCCL's own NCCL_MULTI_RANK_GPU_ENABLE where torch's NCCL has it (>= 2.30),
else a per-rank NCCL_HOSTID (see initialize.share_gpu_env); the summary says which. That is the
NCCL code path for real, but the ranks share one GPU's SMs, so steps 0-3 check correctness only
and step 4 is skipped; a GPU whose compute mode admits one process (Exclusive_Process) is
refused before anything starts. Without a working GPU it says in one line whether torch is a
CPU build or CUDA failed to start, and which torch build the driver runs, and exits with
status 2 (machine.py).

`--rehearse` runs the same steps through the same code on CPU: gloo instead of NCCL, `-k gloo`
instead of `-k nccl`, `--device cpu`, a tiny model and benchmark shape, and no sanitizer
variable (it needs CUDA). The step list, the subprocesses, the time limits, the result files
and the summary are what a GPU run uses, so only NCCL and CUDA themselves are new there.
"""
import argparse
import codecs
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from . import gpu_report, machine
from .gpu_report import PROG, summary
from .rank_output import RANK_LOGS_ENV
from .initialize import (SHARE_GPU_ENV, gpu_count, nccl_version, share_gpu_requested,
                         share_gpu_route)

LARGE_SHAPE = "8192,1,4096,16384"  # s, b, h, m: 64 MiB of bf16 activations per rank and step
# Seconds per step: two ranks time-slicing one GPU over sockets run the suite's NCCL tests
# several times slower than two GPUs do, and the sanitizer slows every kernel launch. The smoke
# step's ranks get SMOKE_TIMEOUT_S for the group and each collective, and 30 s to start.
STEP_TIMEOUT_S = {"nccl-smoke": 300, "nccl-tests": 1800, "sanitizer": 1800, "profile": 1200,
                  "large-overlap": 1800}
SMOKE_TIMEOUT_S = 60
# The rehearsal's sizes: the same flags as on a GPU, at a size a CPU runs in seconds.
TINY_MODEL = ["--steps", "3", "--warmup", "1", "--batch", "2", "--seq", "16", "--hidden", "32",
              "--heads", "4", "--ffn", "64", "--layers", "1", "--bench-iters", "2",
              "--timeline-iters", "1"]


@dataclasses.dataclass
class Step:
    name: str
    argv: list
    env: dict
    what: str
    results: str = None  # the folder it writes, if any
    timeout_s: float = 1800.0
    report: str = None  # a test step's JUnit XML file
    backend: str = None  # a test step's: at least one test of it must pass
    stops_run: bool = False  # if it fails, no later step runs


@dataclasses.dataclass
class Outcome:
    step: Step
    status: str  # "passed", "FAILED", "TIMED OUT", "not run"
    seconds: float
    detail: str  # one line: counts, exit status or time limit
    evidence: list  # a failed step's lines worth pasting back: each failed test and its cause


def plan(gpus, share_gpu, out, python=sys.executable, rehearse=False, tests=None):
    """The steps for a machine with `gpus` GPUs (see the module docstring), writing under `out`;
    `rehearse`: the same steps on CPU/gloo at a tiny size; `tests`: a pytest -k expression:
    both test steps then run the backend's tests that match it, instead of their own selection.
    Raises ValueError (one line) where the machine cannot run them."""
    if gpus == 0:
        raise ValueError("no CUDA GPU here: nothing to check (run it on a machine with NVIDIA "
                         "GPUs; the CPU suite is `bash run_tests.sh`, the same steps on CPU "
                         "`gpu-check --rehearse`)")
    if gpus == 1 and not share_gpu:
        raise ValueError(f"1 CUDA GPU: the NCCL tests need 2 ranks; add --share-gpu (or set "
                         f"{SHARE_GPU_ENV}=1) to run two ranks on this one GPU (a correctness "
                         f"run: its speed means nothing)")
    env = {SHARE_GPU_ENV: "1"} if gpus == 1 else {}
    backend, device = ("gloo", "cpu") if rehearse else ("nccl", "cuda")
    # On CPU a fixed benchmark shape: calibrating one (what a GPU run does) takes seconds.
    sizes = [*TINY_MODEL, "--bench-shape", "16,2,32,64"] if rehearse else ["--steps", "20"]
    package = [python, "-m", "tensor_parallel_toy"]

    def ranks(name):  # where the step's ranks write their own stderr
        return {RANK_LOGS_ENV: os.path.join(out, f"{name}-ranks")}

    def test_step(name, selection, extra_env, what):
        selection = f"{backend} and ({tests})" if tests else selection
        report = os.path.join(out, f"{name}.xml")
        # A test that hangs past the pools' own limits still names itself: pytest dumps the
        # stacks of a test running longer than faulthandler_timeout.
        return Step(name, [*package, "test", "-k", selection, "-o", "faulthandler_timeout=300",
                           f"--junitxml={report}"],
                    {**env, **extra_env, **ranks(name)}, what, timeout_s=STEP_TIMEOUT_S[name],
                    report=report, backend=backend)

    def profile_step(name, flags, what):
        results = os.path.join(out, name)
        return Step(name, [*package, "profile", "--device", device, *flags, "--out", results],
                    {**env, **ranks(name)}, what, results, STEP_TIMEOUT_S[name])

    steps = [
        Step("nccl-smoke", [python, "-m", "tensor_parallel_toy.launcher.smoke", "--device",
                            device, "--timeout", str(SMOKE_TIMEOUT_S)],
             {**env, **ranks("nccl-smoke")},
             f"two {backend} ranks: form the group, all-reduce, a ring step, a barrier",
             timeout_s=STEP_TIMEOUT_S["nccl-smoke"], stops_run=True),
        test_step("nccl-tests", backend, {}, f"the suite's {backend} variants"),
        test_step("sanitizer", f"{backend} and overlap",
                  {} if rehearse else {"TORCH_CUDA_SANITIZER": "1"},
                  f"the overlapped layers' {backend} tests"
                  + (" (the CUDA stream sanitizer needs CUDA: left out)" if rehearse else
                     " under the CUDA stream sanitizer")),
        profile_step("profile", sizes, f"a short profile on {backend}, every phase"),
    ]
    if gpus >= 2:
        shape = "16,1,32,64" if rehearse else LARGE_SHAPE
        steps.append(profile_step(
            "large-overlap",
            ["--dtype", "bf16", "--modes", "tp,tp_overlap",
             *(TINY_MODEL if rehearse else ["--steps", "30", "--bench-iters", "30",
                                            "--timeline-iters", "11"]),
             "--bench-shape", shape],
            f"the overlap benchmark at s,b,h,m = {shape}, bf16"))
    return steps


def _tee(stream, log):
    """Copy a child's output to the screen and its log as it comes (pytest's progress dots
    come without a newline, so not line by line)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        for chunk in iter(lambda: stream.read1(1 << 14), b""):
            log.write(chunk)
            log.flush()
            sys.stdout.write(decoder.decode(chunk))
            sys.stdout.flush()
    except (OSError, ValueError):  # the step was stopped and its log closed: nothing to copy
        pass


def _stop(proc):
    """Kill the step and everything it started: its ranks are in its process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _remove_stale(step):
    """An earlier run's report, results or ranks' output must not stand in for this run's."""
    if step.env.get(RANK_LOGS_ENV):
        shutil.rmtree(step.env[RANK_LOGS_ENV], ignore_errors=True)
    stale = [step.report] + ([os.path.join(step.results, "results.json")] if step.results
                             else [])
    for path in filter(None, stale):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def run_step(step, out, timeout_s=None):
    """Run one step, its output to the screen and OUT/<step>.log, stopped (with every process
    it started) after `timeout_s` (default: the step's own limit). Returns its Outcome."""
    timeout_s = step.timeout_s if timeout_s is None else timeout_s
    log_path = os.path.join(out, f"{step.name}.log")
    _remove_stale(step)
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        # A session of its own: one kill reaches the ranks the step spawned, and Ctrl-C here
        # stops the step through `_stop` instead of leaving it half-killed.
        proc = subprocess.Popen(step.argv, env={**os.environ, **step.env},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        pump = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
        pump.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = None
        except BaseException:
            _stop(proc)
            raise
        pump.join(timeout=10)
        proc.stdout.close()
    seconds = time.perf_counter() - start
    log_name = os.path.basename(log_path)
    tests = gpu_report.read_report(step.report, step.backend)
    evidence = ((tests.failures or gpu_report.evidence(log_path))
                + gpu_report.ranks_output(step.env.get(RANK_LOGS_ENV)))
    if code is None:
        return Outcome(step, "TIMED OUT", seconds,
                       f"stopped after {timeout_s:g} s, the step's time limit{tests.counts}; "
                       f"log {log_name}", evidence)
    if code != 0:
        return Outcome(step, "FAILED", seconds, f"exit {code}{tests.counts}; log {log_name}",
                       evidence)
    if step.report and not tests.backend_passed:
        return Outcome(step, "FAILED", seconds, f"no [{step.backend}] test passed"
                       f"{tests.counts}; log {log_name}", tests.skip_reasons)
    if step.results and not os.path.exists(os.path.join(step.results, "results.json")):
        return Outcome(step, "FAILED", seconds, f"exit 0 but no {step.results}/results.json",
                       [])
    where = f"results in {step.results}/" if step.results else f"log {log_name}"
    return Outcome(step, "passed", seconds,
                   "; ".join(filter(None, [tests.counts.lstrip(", "), where])), [])


def _machine(gpus, rehearse):
    import torch

    if rehearse:
        return (f"machine: CPU, gloo ranks (a rehearsal: on a GPU the same steps run NCCL on "
                f"CUDA, at full size); torch {torch.__version__}")
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    version = nccl_version()
    try:  # NCCL's shared-memory transport lives there (a container's default is 64 MiB)
        shm = f", /dev/shm {shutil.disk_usage('/dev/shm').total / 2**30:.1f} GiB"
    except OSError:
        shm = ", no /dev/shm"
    return (f"machine: {gpus} x {', '.join(names)}; "
            f"{machine.build_line(torch, machine.driver_version())}, NCCL "
            f"{'.'.join(map(str, version or ())) or 'none'}{shm}")


def _parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None,
                   help="folder for the results (default results/gpu, or "
                        "results/gpu-rehearsal with --rehearse; blog/gpu to commit them beside "
                        "the post)")
    p.add_argument("--share-gpu", action="store_true",
                   help=f"run two ranks on one GPU (correctness only); the same as "
                        f"{SHARE_GPU_ENV}=1, which this flag sets for every step")
    p.add_argument("--rehearse", action="store_true",
                   help="run every step on CPU/gloo at a tiny size, as a GPU run would (with "
                        "--share-gpu: the one-GPU plan); works without a GPU")
    p.add_argument("--tests", default=None, metavar="EXPR",
                   help="both test steps run only the NCCL tests (gloo with --rehearse) that "
                        "match pytest -k EXPR, e.g. to run a failed one again")
    p.add_argument("--steps", default=None, metavar="NAMES",
                   help="run only these steps (comma-separated, e.g. a failed one again: "
                        "--steps sanitizer --tests ring_buffers)")
    p.add_argument("--step-timeout", default=None, metavar="S|STEP=S,...",
                   help="seconds each step may take before it is stopped, for every step (S) "
                        "or per step (e.g. nccl-tests=240,profile=120; the others keep "
                        "theirs); default per step: "
                        + ", ".join(f"{k} {v:g}" for k, v in STEP_TIMEOUT_S.items()))
    p.add_argument("--dry-run", action="store_true",
                   help="print the steps' commands and stop (works without a GPU)")
    return p


def _problem(args, share, gpus):
    """The one line that stops the run before any step, or None."""
    flag = os.environ.get(SHARE_GPU_ENV, "")
    if flag not in ("", "0", "1"):
        return f"{SHARE_GPU_ENV}={flag!r}: valid are 1 (ranks share a GPU) or 0 or unset"
    if args.step_timeout is not None:
        try:
            step_timeouts(args.step_timeout)
        except ValueError as e:
            return str(e)
    if args.rehearse or args.dry_run:
        return None
    if gpus == 0:
        return machine.cuda_problem()
    # Every GPU the run uses, not only a shared one: the suite's pools of 2, 3 and 4 ranks run
    # side by side, each with its rank 0 on GPU 0, its rank 1 on GPU 1, ...
    single = {i: mode for i, mode in machine.single_process_gpus().items() if i < gpus}
    if single:
        first = min(single)
        why = ("two ranks cannot share it" if share and gpus == 1 else
               "the suite's pools, which run side by side, cannot all use it")
        return (f"GPU {first}'s compute mode is {single[first]}: it admits at most one "
                f"process, so {why}; `nvidia-smi -i {first} -c DEFAULT` (as root) allows "
                f"several")
    return None


def step_timeouts(text):
    """`--step-timeout`'s value as {step: seconds} ("" for every step); ValueError (one line)
    for anything but a positive number or STEP=positive number items."""
    limits = {}
    for item in text.split(","):
        name, _, value = item.strip().rpartition("=")
        if name and name not in STEP_TIMEOUT_S:
            raise ValueError(f"--step-timeout {text!r}: {name!r} is not a step; valid are "
                             f"{', '.join(STEP_TIMEOUT_S)}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not seconds > 0 or name in limits or (not name and "," in text):
            raise ValueError(f"--step-timeout {text!r}: valid are one positive number of "
                             f"seconds for every step, or STEP=SECONDS items, once per step")
        limits[name] = seconds
    return limits


def _only(steps, names):
    """The planned steps named in `names` (comma-separated), in their order."""
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = [step.name for step in steps]
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        raise ValueError(f"--steps {names!r}: {', '.join(unknown) or 'no step'} is not a step "
                         f"of this plan; valid are {', '.join(known)}")
    return [step for step in steps if step.name in wanted]


def main(argv=None, gpus=None):
    args = _parser().parse_args(argv)
    share = args.share_gpu or share_gpu_requested()
    if gpus is None:
        gpus = 0 if args.rehearse else gpu_count()
    planned = (1 if share else 2) if args.rehearse or (args.dry_run and gpus == 0) else gpus
    out = args.out or os.path.join("results", "gpu-rehearsal" if args.rehearse else "gpu")
    try:
        problem = _problem(args, share, gpus)
        if problem:
            raise ValueError(problem)
        steps = plan(planned, share, out, rehearse=args.rehearse, tests=args.tests)
        if args.steps is not None:
            steps = _only(steps, args.steps)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    limits = step_timeouts(args.step_timeout) if args.step_timeout else {}
    for step in steps:
        step.timeout_s = limits.get(step.name, limits.get("", step.timeout_s))
    if args.dry_run:
        for step in steps:
            env = " ".join(f"{k}={v}" for k, v in step.env.items())
            print(f"{step.name} (limit {step.timeout_s:g} s): {env + ' ' if env else ''}"
                  f"{shlex.join(step.argv)}")
        return 0
    os.makedirs(out, exist_ok=True)
    shared = planned == 1
    sharing = (f"sharing: two ranks on one GPU, {share_gpu_route()}: this run checks "
               f"correctness, not speed" if shared else "")
    print(f"{PROG}{' --rehearse' if args.rehearse else ''}: {len(steps)} steps, results in "
          f"{out}/" + (f"; {sharing}" if shared else ""), flush=True)
    outcomes, interrupted, stop = [], False, None
    for step in steps:
        if stop:
            outcomes.append(Outcome(step, "not run", 0.0, f"{stop} failed: later steps start "
                                    f"ranks the same way", []))
            continue
        env = " ".join(f"{k}={v}" for k, v in step.env.items())
        print(f"\n=== {step.name}: {step.what}\n    {env + ' ' if env else ''}"
              f"{shlex.join(step.argv)}", flush=True)
        try:
            outcomes.append(run_step(step, out))
        except KeyboardInterrupt:
            interrupted = True
            outcomes.append(Outcome(step, "FAILED", 0.0, "interrupted (Ctrl-C): stopped, with "
                                    "every step after it", []))
        print(f"=== {step.name}: {outcomes[-1].status}, {outcomes[-1].detail}", flush=True)
        if interrupted:
            break
        if step.stops_run and outcomes[-1].status != "passed":
            stop = step.name
    skipped = [("large-overlap", "two ranks on one GPU: timings mean nothing")] if shared else []
    text = summary(outcomes, out, skipped, _machine(planned, args.rehearse), sharing,
                   args.rehearse)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text)
    print(f"\n{text}", end="", flush=True)
    if interrupted:
        return 130
    return 0 if all(o.status == "passed" for o in outcomes) else 1
