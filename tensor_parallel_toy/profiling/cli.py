"""`python -m tensor_parallel_toy profile`: train baseline / tp / tp_overlap / dtensor side by
side, benchmark the overlap op by op, record a timeline, and write it all to a results folder.

Every flag is checked before any process starts: a bad value is one line on stderr and exit
status 2. Locally the ranks are a `WorkerPool` spawned once for every phase; under `torchrun`
each rank runs the same phases and rank 0 gathers the numbers and writes the files. With
`--link RATE` (Linux, root) each rank runs that torchrun path in its own network namespace
behind a shaped link (link.py); several rates make a sweep over them (sweep.py).

    results/results.json   every number, the config, versions, device, backend, world size
    results/summary.txt    the table printed at the end, with the targets
    results/loss.png, grad_norm.png, step_time.png, memory.png, overlap.png, timeline.png
    results/trace_<mode>_rank<r>.json   with --trace: torch.profiler Chrome traces (Perfetto)
"""
import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist

from .. import dtensor_tp
from ..config import ModelConfig, check_seq_len
from ..initialize import LaunchError, WorkerPool, choose_backend, init_from_env, shutdown
from . import bench_overlap, link, plots, report, sweep, timeline, train
from .data import CORPUS_VOCAB
from .output import write_text
from .spec import DTYPES, MODEL_DEFAULTS, MODELS, MODES, ProfileSpec

PROG = "python -m tensor_parallel_toy profile"
PHASE_TIMEOUT_S = 3600.0


class UsageError(Exception):
    """A bad flag: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser():
    d, m = ProfileSpec(), MODEL_DEFAULTS  # every default is defined there, once
    p = _Parser(prog=PROG, description="Train the baseline, hand-written TP (with and without "
                "overlap) and PyTorch DTensor TP side by side on the same data and weights; "
                "benchmark the overlap per op; draw the timeline.")
    p.add_argument("--tp", type=int, default=None, help=f"tensor-parallel size (default {d.tp}; "
                   f"under torchrun the world size / --dp)")
    p.add_argument("--dp", type=int, default=d.dp, help=f"data-parallel size: above 1 the TP "
                   f"modes run 2-D, FSDP2 over dp copies of the TP model, dp x tp ranks "
                   f"(default {d.dp})")
    p.add_argument("--steps", type=int, default=d.steps,
                   help=f"training steps per mode (default {d.steps})")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help=f"first steps left out of the timing statistics, at least 1 "
                        f"(default {d.warmup})")
    p.add_argument("--batch", type=int, default=d.batch,
                   help=f"global batch size (default {d.batch})")
    p.add_argument("--seq", type=int, default=d.seq, help=f"sequence length (default {d.seq})")
    p.add_argument("--hidden", type=int, default=m["hidden_size"],
                   help=f"hidden size (default {m['hidden_size']})")
    p.add_argument("--layers", type=int, default=m["num_layers"],
                   help=f"transformer blocks (default {m['num_layers']})")
    p.add_argument("--heads", type=int, default=m["num_heads"],
                   help=f"attention heads (default {m['num_heads']})")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads for grouped-query "
                   "attention (default: --heads, i.e. multi-head)")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="one weight for the embedding and the LM head (not with dtensor or "
                        "hf_dtensor)")
    p.add_argument("--ffn", type=int, default=m["ffn_hidden_size"],
                   help=f"MLP hidden size (default {m['ffn_hidden_size']})")
    p.add_argument("--vocab", type=int, default=m["vocab_size"], help=f"vocabulary size, at "
                   f"least {CORPUS_VOCAB} for the ASCII corpus (default {m['vocab_size']})")
    p.add_argument("--lr", type=float, default=d.lr,
                   help=f"AdamW learning rate (default {d.lr:g})")
    p.add_argument("--dtype", default=d.dtype, help=f"{' or '.join(DTYPES)} (default {d.dtype})")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto: one GPU "
                   "per rank when there are enough, else CPU)")
    p.add_argument("--out", default="results", help="output folder (default results/)")
    p.add_argument("--model", default=d.model, help=f"{' or '.join(MODELS)}: the network, "
                   f"with a GELU MLP or Llama's SwiGLU MLP (default {d.model})")
    p.add_argument("--modes", default=None, help="comma-separated subset of the model's modes, "
                   + "; ".join(f"{k}: {','.join(v['modes'])}" for k, v in MODELS.items())
                   + " (default all of them)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank "
                   "(default: CPU cores / ranks)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"weights and data seed (default {d.seed})")
    p.add_argument("--bench-iters", type=int, default=d.bench_iters, help=f"timed rounds per op "
                   f"in the overlap benchmark, 0 to skip it (default {d.bench_iters})")
    p.add_argument("--bench-shape", default=None, metavar="S,B,H,F", help="overlap benchmark "
                   "shapes (default: the model's s, b, h and an f calibrated on this machine)")
    p.add_argument("--timeline-iters", type=int, default=d.timeline_iters, help=f"recordings of "
                   f"the timeline per mode, the median one is drawn; 0 to skip (default "
                   f"{d.timeline_iters})")
    p.add_argument("--timeout", type=float, default=PHASE_TIMEOUT_S, help=f"seconds a phase "
                   f"may take before the run is stopped; under torchrun also the limit for "
                   f"joining the process group and for each collective (default "
                   f"{PHASE_TIMEOUT_S:g})")
    p.add_argument("--trace", action="store_true",
                   help="also export a torch.profiler Chrome trace of one step per TP mode")
    p.add_argument("--link", default=None, metavar="RATE", help="Linux, as root: run each TP "
                   "rank in its own network namespace, the ranks joined by a link shaped to "
                   "RATE (e.g. 4gbit, 500mbit) with tc tbf, as if on separate hosts (see "
                   "profiling/link.py). Several rates (1gbit,2gbit,4gbit,8gbit): a sweep of tp "
                   "and tp_overlap over them and loopback, written to sweep.json and sweep.png")
    return p


def _under_torchrun(env):
    return "RANK" in env and "WORLD_SIZE" in env


def _check_int(name, value, low, high=None):
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise UsageError(f"--{name} {value}: must be {bound}")


def parse_args(argv, env=os.environ):
    """Parse and check every flag; raise UsageError (one line) before anything starts."""
    args = build_parser().parse_args(argv)
    _check_int("dp", args.dp, 1, 64)
    if _under_torchrun(env):
        world = int(env["WORLD_SIZE"])
        tp = world // args.dp if args.tp is None else args.tp
        if tp * args.dp != world:
            raise UsageError(f"--dp {args.dp} x --tp {tp} = {tp * args.dp} ranks does not match "
                             f"torchrun's world size {world}; the world is the dp x tp grid")
        args.tp = tp
    args.tp = ProfileSpec.tp if args.tp is None else args.tp
    _check_int("tp", args.tp, 2, 64)
    if args.batch % args.dp:
        raise UsageError(f"--batch {args.batch} is not divisible by --dp {args.dp}: each "
                         f"data-parallel rank trains on batch / dp rows; use --batch "
                         f"{args.batch + (-args.batch) % args.dp}")
    _check_int("steps", args.steps, 2, 100_000)
    if args.warmup < 1:
        raise UsageError(f"--warmup {args.warmup}: must be at least 1 (the first step allocates "
                         f"and carries the memory measurement, it is never timed)")
    if args.steps - args.warmup < 2:
        raise UsageError(f"--steps {args.steps} with --warmup {args.warmup} leaves "
                         f"{args.steps - args.warmup} timed steps; need at least 2")
    for name in ("batch", "seq", "hidden", "layers", "heads", "ffn", "vocab"):
        _check_int(name, getattr(args, name), 1)
    _check_int("seed", args.seed, 0)
    _check_int("bench-iters", args.bench_iters, 0)
    _check_int("timeline-iters", args.timeline_iters, 0)
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    if not args.lr > 0:
        raise UsageError(f"--lr {args.lr}: must be a positive number")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype {args.dtype!r}: valid: {', '.join(DTYPES)}")
    if args.vocab < CORPUS_VOCAB:
        raise UsageError(f"--vocab {args.vocab}: the corpus is ASCII text, token ids go up to "
                         f"{CORPUS_VOCAB - 1}; use --vocab {CORPUS_VOCAB} or more")
    if args.model not in MODELS:
        raise UsageError(f"--model {args.model!r}: valid: {', '.join(MODELS)}")
    valid = MODELS[args.model]["modes"]
    modes = [m.strip() for m in (args.modes or ",".join(valid)).split(",") if m.strip()]
    bad = [m for m in modes if m not in valid]
    if not modes or bad:
        raise UsageError(f"--modes {args.modes!r}: valid modes with --model {args.model} are "
                         f"{', '.join(valid)}" + _other_model_hint(bad))
    args.modes = [m for m in MODES if m in modes]  # always in the canonical order
    try:
        args.config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                  num_layers=args.layers, num_heads=args.heads,
                                  ffn_hidden_size=args.ffn, max_seq_len=args.seq,
                                  num_kv_heads=args.kv_heads,
                                  tie_embeddings=args.tie_embeddings,
                                  mlp=MODELS[args.model]["mlp"])
        args.config.check_tp_size(args.tp)
        check_seq_len(args.seq, args.tp, args.seq)
        if "dtensor" in args.modes:
            dtensor_tp.check_plan(args.config, args.tp)
            if args.seq % args.tp:
                raise ValueError(
                    f"sequence length {args.seq} is not divisible by the TP size {args.tp}: the "
                    f"dtensor mode needs equal sequence shards (the hand-written modes pad); "
                    f"use --seq {args.seq + (-args.seq) % args.tp} or leave dtensor out of --modes")
        if "hf_dtensor" in args.modes:
            _check_hf_dtensor(args.config, args.tp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    args.bench_shape = _parse_bench_shape(args.bench_shape, args.tp)
    args.link_rates = _check_link(args.link, args.device, args.dp, env)
    args.backend = _check_device(args.device, args.tp * args.dp, env)
    if args.threads is not None:
        _check_int("threads", args.threads, 1, 1024)
    _check_out(args.out)
    args.spec = ProfileSpec(
        config=args.config, model=args.model, tp=args.tp, dp=args.dp, steps=args.steps,
        warmup=args.warmup, batch=args.batch, seq=args.seq, lr=args.lr, dtype=args.dtype,
        seed=args.seed, modes=tuple(args.modes),
        threads=args.threads, bench_iters=args.bench_iters,
        bench_shape=args.bench_shape,
        timeline_iters=args.timeline_iters,
        trace_dir=os.path.abspath(args.out) if args.trace else None)
    return args


def _check_hf_dtensor(config, tp):
    """What the hf_dtensor mode cannot run, as a ValueError, without building the model: the
    plan's checks on the sizes its LlamaConfig will have (hf_llama.py)."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("the hf_dtensor mode needs transformers (pip install -r "
                         "requirements.txt), or leave it out of --modes")
    dtensor_tp.check_hf_plan(types.SimpleNamespace(
        tie_word_embeddings=config.tie_embeddings, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, intermediate_size=config.ffn_hidden_size,
        vocab_size=config.vocab_size, hidden_size=config.hidden_size), tp)


def _other_model_hint(bad):
    """' (mode m needs --model k)' for a mode that another --model runs, else ''."""
    hints = [f"{m} needs --model {k}" for m in bad for k, v in MODELS.items() if m in v["modes"]]
    return f" ({'; '.join(hints)})" if hints else ""


def _parse_bench_shape(text, tp):
    if text is None:
        return None
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise UsageError(f"--bench-shape {text!r}: give four positive integers S,B,H,F")
    s, _, _, f = shape
    if s % tp or f % tp:
        raise UsageError(f"--bench-shape {text!r}: S={s} and F={f} must be divisible by "
                         f"the TP size {tp}")
    return shape


def _check_link(text, device, dp, env):
    if text is None:
        return None
    if _under_torchrun(env):
        raise UsageError("--link starts one rank per network namespace itself; run it as a "
                         "plain command, not under torchrun")
    if device == "cuda":
        raise UsageError("--link emulates a network between CPU hosts (gloo); it cannot be "
                         "combined with --device cuda")
    if dp > 1:
        raise UsageError(f"--link with --dp {dp}: the emulated link runs one TP group (one "
                         f"rank per namespace); leave out --dp")
    try:
        return link.parse_rates(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_device(device, ranks, env):
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: valid: auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available; use --device cpu")
    local = int(env.get("LOCAL_WORLD_SIZE", ranks)) if _under_torchrun(env) else ranks
    try:
        return choose_backend(local, device)
    except ValueError as e:
        raise UsageError(f"--device {device}: {e}") from None


def _check_out(out):
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out!r} exists and is not a folder")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out!r}: cannot create it ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out!r}: the folder is not writable")


# ----------------------------------------------------------------------------------------------
# Running the phases on the ranks
# ----------------------------------------------------------------------------------------------
def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _threads(n=None):
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
        mine = fn(*args)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return gathered


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


def run_phases(runner, args):
    """All phases; returns the results dict (complete on rank 0)."""
    spec = args.spec
    threads = runner.run(_threads, spec.threads)
    if spec.dp > 1 and (spec.bench_iters > 0 or spec.timeline_iters > 0):
        _say(runner, f"skipping the per-op benchmark and the timeline with --dp {spec.dp}: they "
                     f"time single TP ops and one block, which data parallelism does not change; "
                     f"run them with --dp 1")
        spec = dataclasses.replace(spec, bench_iters=0, timeline_iters=0)
    phases = 1 + (spec.bench_iters > 0) + (spec.timeline_iters > 0)
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
    results = {"meta": _meta(args, threads, load), "config": _config(args), "modes": modes,
               "ratios": report.step_time_ratios(modes, spec.warmup)}
    if spec.bench_iters > 0:
        k += 1
        _say(runner, f"[{k}/{phases}] per-op overlap benchmark ({spec.bench_iters} rounds)")
        with _LoadMeter(runner) as meter:
            bench = bench_overlap.summarize(runner.run(bench_overlap.run, spec))
        load["overlap_benchmark"] = meter.cores
        results["overlap_benchmark"] = bench
        sh = bench["shape"]
        _say(runner, f"      shapes: s={sh['s']} b={sh['b']} h={sh['h']} f={sh['f']} "
                     f"p={sh['p']}" + (" (f calibrated)" if sh["calibrated"] else ""))
    if spec.timeline_iters > 0:
        k += 1
        _say(runner, f"[{k}/{phases}] timeline of one block ({spec.timeline_iters} recordings "
                     f"per mode)")
        with _LoadMeter(runner) as meter:
            per_rank = runner.run(timeline.record, spec)
        load["timeline"] = meter.cores
        spans = {mode: [r[mode] for r in per_rank] for mode in per_rank[0]}
        results["timeline"] = {"iterations": spec.timeline_iters,
                               "summary": timeline.summarize(per_rank), "spans": spans}
    results["targets"] = report.evaluate_targets(results)
    return results


def _meta(args, threads, load):
    return {"torch": torch.__version__, "python": platform.python_version(),
            "device": "cuda" if args.backend == "nccl" else "cpu",
            "gpu": torch.cuda.get_device_name(0) if args.backend == "nccl" else None,
            "backend": args.backend, "world_size": args.tp * args.dp, "tp": args.tp,
            "dp": args.dp,
            "cpu_count": os.cpu_count(), "threads_per_rank": threads[0],
            "baseline_threads": args.spec.baseline_threads, "external_load_cores": load,
            "launcher": ("--link: one rank per network namespace" if link.LINK_ENV in os.environ
                         else "torchrun" if _under_torchrun(os.environ) else "WorkerPool"),
            "link": (json.loads(os.environ[link.LINK_ENV]) if link.LINK_ENV in os.environ
                     else None),
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
    plots.plot_memory(modes, os.path.join(out, "memory.png"))
    if "overlap_benchmark" in results:
        plots.plot_overlap(results["overlap_benchmark"], os.path.join(out, "overlap.png"),
                           network)
        files["overlap.png"] = None
    if "timeline" in results:
        plots.plot_timeline(results["timeline"]["spans"], os.path.join(out, "timeline.png"),
                            "", network)
        files["timeline.png"] = None
    if results["config"]["run"].get("trace"):
        files.update({f"trace_{m}_rank{r}.json": None for m in results["modes"]
                      if m != "baseline" for r in range(results["meta"]["world_size"])})
    results["files"] = sorted(files)
    summary = report.summary_text(results)
    write_text(os.path.join(out, "summary.txt"), summary)
    write_text(os.path.join(out, "results.json"), json.dumps(results, indent=1))
    return summary


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    args.argv = argv
    if args.link is not None:
        return _run_on_link(args, argv)
    start = time.perf_counter()
    if _under_torchrun(os.environ):
        try:  # the first collective: where a wrong address or network interface shows
            init_from_env(args.backend, timeout_s=args.timeout)
        except LaunchError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        try:
            runner = TorchrunRunner()
            results = run_phases(runner, args)
        finally:
            shutdown()
        if runner.rank != 0:
            return 0
    else:
        ranks = args.tp * args.dp
        print(f"spawning {ranks} ranks ({args.backend})...", flush=True)
        with WorkerPool(ranks, backend=args.backend) as pool:
            results = run_phases(PoolRunner(pool, args.timeout), args)
    results["meta"]["runtime_s"] = time.perf_counter() - start
    summary = write_outputs(results, args.out)
    print("\n" + summary, end="")
    print(f"wrote {', '.join(results['files'])} to {args.out}/ "
          f"in {results['meta']['runtime_s']:.0f} s")
    return 0


def _run_on_link(args, argv):
    """One rank per network namespace, each the torchrun path of this same command."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.tp)
    command = [sys.executable, "-m", "tensor_parallel_toy", "profile",
               *link.argv_for_ranks(argv, threads)]
    try:
        link.check_host()
        if len(args.link_rates) > 1:
            return sweep.run(argv, args, threads)
        (bps, rate), = args.link_rates
        with link.EmulatedLink(args.tp, bps, rate) as net:
            print(report.link_text(net.describe()), flush=True)
            net.run_ranks(command)
    except link.LinkUnavailable as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except (link.RankFailed, subprocess.CalledProcessError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted: stopped the ranks and removed the link", file=sys.stderr)
        return 130
    return 0
