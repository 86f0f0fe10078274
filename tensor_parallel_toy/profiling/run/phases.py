"""The profile's phases on the ranks, and its output files.

`run_phases(runner, args)` runs, on every rank, the interleaved training of all modes
(train.py), one step of classic TP without sequence parallelism for its memory (tp_no_sp.py),
the per-op overlap benchmark and the timeline, and turns the per-rank numbers into
results.json's sections (report/report.py). A runner is where the ranks are: a local `WorkerPool`
(`PoolRunner`) or the ranks of a torchrun job, this process being one of them
(`TorchrunRunner`). `write_outputs` renders every file into a staging folder and moves them
into place.
"""
import dataclasses
import datetime
import json
import os
import platform
import resource
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from ...guards.collectives import all_gather_objects
from ..measure import bench_overlap, timeline
from ..measure.metrics import keep_freed_memory
from ..report import landing, plots, report, targets
from ..report.output import write_text
from ..wires import link, wire
from . import tp_no_sp, train

PHASE_TIMEOUT_S = 3600.0


def under_torchrun(env):
    return "RANK" in env and "WORLD_SIZE" in env


# ----------------------------------------------------------------------------------------------
# Running the phases on the ranks
# ----------------------------------------------------------------------------------------------
def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _threads(n=None):
    keep_freed_memory()
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def _busy_cpu_seconds():
    """CPU seconds spent by the whole machine (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


class PoolRunner:
    """Runs a phase on every rank of a local `WorkerPool`; the results come back here."""

    def __init__(self, pool, timeout_s=PHASE_TIMEOUT_S):
        self.pool, self.rank, self.timeout_s = pool, 0, timeout_s

    def run(self, fn, *args):
        return self.pool.run(fn, *args, timeout_s=self.timeout_s)


class TorchrunRunner:
    """Every rank runs the phase; the per-rank results are gathered on every rank."""

    def __init__(self):
        self.rank = dist.get_rank()

    def run(self, fn, *args):
        return all_gather_objects(fn(*args), dist.group.WORLD)


def _say(runner, text):
    if runner.rank == 0:
        print(text, flush=True)


class _LoadMeter:
    """CPU used by other work on this machine during a phase, in cores: the machine's busy
    time (/proc/stat) minus what our own processes used. Local pool on Linux only."""

    def __init__(self, runner):
        self.runner = runner
        self.enabled = isinstance(runner, PoolRunner) and _busy_cpu_seconds() is not None

    def __enter__(self):
        if self.enabled:
            self.ours = sum(self.runner.run(_cpu_seconds)) + _cpu_seconds()
            self.busy, self.wall = _busy_cpu_seconds(), time.perf_counter()
        self.cores = None
        return self

    def __exit__(self, *exc):
        if self.enabled and exc[0] is None:
            busy, wall = _busy_cpu_seconds(), time.perf_counter()
            ours = sum(self.runner.run(_cpu_seconds)) + _cpu_seconds() - self.ours
            self.cores = max(0.0, (busy - self.busy - ours) / (wall - self.wall))


def _weight_grad_path(dtype):
    """How the overlapped layers sum a weight gradient of `dtype` on this rank's device, in
    words (ring.py's WeightGradAccumulator), for the results."""
    import torch

    from ...launcher.initialize import current_device
    from ...ring import has_fp32_out_gemm
    if dtype == torch.float32:
        return "fp32 GEMMs into an fp32 sum"
    if has_fp32_out_gemm(current_device().type):
        return f"{str(dtype).replace('torch.', '')} GEMMs with fp32 output into an fp32 sum"
    return "inputs upcast to fp32, fp32 GEMMs into an fp32 sum"


def run_phases(runner, args):
    """All phases; returns the results dict (complete on rank 0)."""
    spec = args.spec
    if spec.wire is not None:  # --link model:RATE: every phase's transfers on the modeled wire
        runner = wire.WiredRunner(runner, spec.wire)
    threads = runner.run(_threads, spec.threads)
    wgrad = runner.run(_weight_grad_path, spec.torch_dtype)[0]
    if spec.dp > 1 and (spec.bench_iters > 0 or spec.timeline_iters > 0):
        _say(runner, f"skipping the per-op benchmark and the timeline with --dp {spec.dp}: they "
                     f"time single TP ops and one block, which data parallelism does not change; "
                     f"run them with --dp 1")
        spec = dataclasses.replace(spec, bench_iters=0, timeline_iters=0)
    classic_skip = ("it runs on one TP group, use --dp 1" if spec.dp > 1
                    else tp_no_sp.unsupported(spec.config, spec.tp))
    phases = 1 + (classic_skip is None) + (spec.bench_iters > 0) + (spec.timeline_iters > 0)
    tokens = spec.batch * spec.seq
    load, k = {}, 1
    _say(runner, f"[1/{phases}] {', '.join(spec.modes)}: {spec.steps} steps each, interleaved "
                 f"step by step" + (" (baseline on rank 0 alone)" if "baseline" in spec.modes
                                    else ""))
    with _LoadMeter(runner) as meter:
        per_rank = runner.run(train.run_modes, spec.modes, spec)
    modes = {mode: report.combine_mode([r.get(mode) for r in per_rank], spec.warmup, tokens)
             for mode in spec.modes}
    load["modes"] = meter.cores
    report.add_baseline_errors(modes)
    results = {"meta": {**_meta(args, threads, load), "overlap_weight_grad": wgrad},
               "config": _config(args), "modes": modes,
               "ratios": report.step_time_ratios(modes, spec.warmup)}
    if classic_skip is None:
        k += 1
        _say(runner, f"[{k}/{phases}] classic TP without sequence parallelism: one step, for its "
                     f"memory (not a training mode)")
        results["memory_tp_no_sp"] = tp_no_sp.summarize(runner.run(tp_no_sp.measure, spec),
                                                        spec.dtype)
    else:
        _say(runner, f"skipping classic TP without sequence parallelism: {classic_skip}")
    if spec.bench_iters > 0:
        k += 1
        _say(runner, f"[{k}/{phases}] per-op overlap benchmark ({spec.bench_iters} rounds)")
        with _LoadMeter(runner) as meter:
            bench = bench_overlap.summarize(runner.run(bench_overlap.run, spec))
        load["overlap_benchmark"] = meter.cores
        results["overlap_benchmark"] = bench
        sh = bench["shape"]
        _say(runner, f"      shapes: s={sh['s']} b={sh['b']} h={sh['h']} m={sh['f']} "
                     f"p={sh['p']}" + (" (MLP size m calibrated)" if sh["calibrated"] else ""))
    if spec.timeline_iters > 0:
        k += 1
        _say(runner, f"[{k}/{phases}] timeline of one block ({spec.timeline_iters} recordings "
                     f"per mode)")
        with _LoadMeter(runner) as meter:
            per_rank = runner.run(timeline.record, spec)
        load["timeline"] = meter.cores
        spans = {mode: [r[mode]["spans"] for r in per_rank] for mode in per_rank[0]}
        results["timeline"] = {"iterations": spec.timeline_iters,
                               "summary": timeline.summarize(per_rank), "spans": spans}
    land = landing.landing(results)
    if land:
        results["landing"] = land
    results["targets"] = targets.evaluate_targets(results)
    return results


def _meta(args, threads, load):
    return {"torch": torch.__version__, "python": platform.python_version(),
            "device": "cuda" if args.backend == "nccl" else "cpu",
            "gpu": torch.cuda.get_device_name(0) if args.backend == "nccl" else None,
            "backend": args.backend, "world_size": args.tp * args.dp, "tp": args.tp,
            "nccl_high_priority_streams": args.nccl_high_priority,
            "dp": args.dp,
            "cpu_count": os.cpu_count(), "threads_per_rank": threads[0],
            "baseline_threads": args.spec.baseline_threads, "external_load_cores": load,
            "launcher": ("--link: one rank per network namespace" if link.LINK_ENV in os.environ
                         else "torchrun" if under_torchrun(os.environ) else "WorkerPool"),
            "link": (json.loads(os.environ[link.LINK_ENV]) if link.LINK_ENV in os.environ
                     else args.spec.wire),
            "ring_pieces": args.spec.ring_pieces,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(["python -m tensor_parallel_toy profile", *args.argv])}


def _config(args):
    model = {k: getattr(args.config, k) for k in args.config.__dataclass_fields__}
    run = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
           "seq": args.seq, "lr": args.lr,
           "optimizer": f"AdamW(betas=(0.9, 0.95), weight_decay=0.1), lr ramped "
                        f"linearly over the first {train.LR_WARMUP_STEPS} steps",
           "dtype": args.dtype, "seed": args.seed, "modes": args.modes, "trace": args.trace,
           "data": "toy-grammar ASCII corpus (data.py), same global batch for every mode"}
    return {"model": model, "run": run}


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------
def write_outputs(results, out):
    """Render every file into a staging folder inside `out`, then move each into place,
    results.json last. An interrupted run (or a failing plot) leaves the previous run's files
    as they were, and each move is an atomic rename: no reader sees a half-written file."""
    stage = tempfile.mkdtemp(dir=out, prefix=".staging-")
    try:
        summary = _render_outputs(results, stage)
        staged = sorted(os.listdir(stage), key=lambda name: name == "results.json")
        for name in staged:
            os.replace(os.path.join(stage, name), os.path.join(out, name))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return summary


def _render_outputs(results, out):
    files = {"results.json": None, "summary.txt": None, "loss.png": None,
             "grad_norm.png": None, "step_time.png": None, "memory.png": None}
    modes = results["modes"]
    plots.plot_losses(modes, os.path.join(out, "loss.png"))
    plots.plot_grad_norms(modes, os.path.join(out, "grad_norm.png"))
    network = report.link_label(results["meta"])
    plots.plot_step_times(modes, os.path.join(out, "step_time.png"), network)
    plots.plot_memory(modes, os.path.join(out, "memory.png"), results.get("memory_tp_no_sp"))
    if "overlap_benchmark" in results:
        plots.plot_overlap(results["overlap_benchmark"], os.path.join(out, "overlap.png"),
                           network)
        files["overlap.png"] = None
    if "timeline" in results:
        plots.plot_timeline(results["timeline"]["spans"], os.path.join(out, "timeline.png"),
                            "", network, results["timeline"]["summary"])
        files["timeline.png"] = None
    if results["config"]["run"].get("trace"):
        files.update({f"trace_{m}_rank{r}.json": None for m in results["modes"]
                      if m != "baseline" for r in range(results["meta"]["world_size"])})
    results["files"] = sorted(files)
    summary = report.summary_text(results)
    write_text(os.path.join(out, "summary.txt"), summary)
    write_text(os.path.join(out, "results.json"), json.dumps(results, indent=1))
    return summary
