"""The `profile` command's flags: the parser, and every check a flag's value must pass, run
before any process starts. A bad value is a `UsageError`, which the command prints as one line
on stderr with exit status 2 (cli.py); `parse_args` returns the checked namespace, with the
run's `ProfileSpec` and backend filled in.
"""
import argparse
import difflib
import importlib.util
import math
import os
import types

import torch

from ..config import ModelConfig
from ..interop import dtensor_tp
from ..launcher.initialize import choose_backend
from .run.data import CORPUS_VOCAB
from .run.phases import PHASE_TIMEOUT_S, under_torchrun
from .spec import DTYPES, MODEL_DEFAULTS, MODELS, MODES, ProfileSpec
from .wires import link, wire

PROG = "python -m tensor_parallel_toy profile"


class UsageError(Exception):
    """A bad flag: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message + _did_you_mean(self, message))


def _did_you_mean(parser, message):
    """"; did you mean --steps?" for each unknown flag in argparse's message near a real one."""
    if "unrecognized arguments:" not in message:
        return ""
    known = [o for action in parser._actions for o in action.option_strings]
    close = {flag: difflib.get_close_matches(flag.split("=")[0], known, n=1, cutoff=0.6)
             for flag in message.split("unrecognized arguments:")[1].split()
             if flag.startswith("-")}
    hints = [f"{m[0]} for {flag}" for flag, m in close.items() if m]
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def _check_tp_divides_all(config, tp):
    """Every size the TP size does not divide, in one line (check_tp_size names the first; the
    vocabulary is padded, but the dtensor mode's check refuses it)."""
    names = ("hidden_size", "num_heads", "ffn_hidden_size")
    bad = [f"{n}={getattr(config, n)}" for n in names if getattr(config, n) % tp]
    if len(bad) > 1:
        common = math.gcd(*(getattr(config, n) for n in names))
        valid = [d for d in range(2, 65) if common % d == 0]
        raise ValueError(f"{', '.join(bad)} are not divisible by the tensor-parallel size {tp}; "
                         f"valid TP sizes for all of them: {valid}")


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
    p.add_argument("--nccl-high-priority", action="store_true",
                   help="NCCL only: run NCCL's internal CUDA streams (where the ring's transfers "
                        "and asynchronous collectives run) at high priority, so their kernels "
                        "are scheduled ahead of the GEMMs' (default: normal priority, as torch)")
    guard = "off" if d.check_replicated_grads is None else str(d.check_replicated_grads)
    p.add_argument("--check-replicated-grads", default=guard, metavar="first|off|N",
                   help=f"the TP modes' check that every replicated weight's gradient is the "
                        f"same on every TP rank: after the first backward (first), after "
                        f"every N-th backward, or off (default {guard}); 1-D runs only")
    p.add_argument("--trace", action="store_true",
                   help="also export a torch.profiler Chrome trace of one step per TP mode")
    p.add_argument("--link", default=None, metavar="RATE", help="Linux, as root: run each TP "
                   "rank in its own network namespace, the ranks joined by a link shaped to "
                   "RATE (e.g. 4gbit, 500mbit) with tc tbf, as if on separate hosts (see "
                   "profiling/wires/link.py). Several rates (1gbit,2gbit,4gbit,8gbit): a sweep "
                   "of tp and tp_overlap over them and loopback, written to sweep.json and "
                   "sweep.png. "
                   "model:RATE[:LATENCY] (e.g. model:1gbit, model:4gbit:50us): a model of a "
                   "wire that costs the cores nothing, no root needed (profiling/wires/wire.py); "
                   "several (model:0.25gbit,1gbit,4gbit): the column forward swept over "
                   "them and over ring pieces, wire_sweep.json and wire_sweep.png")
    p.add_argument("--ring-pieces", type=int, default=d.ring_pieces, metavar="M",
                   help=f"tp_overlap: cut each ring chunk into M transfers, a piece's GEMM "
                        f"starting as soon as it is here (ring_pieces=M; default {d.ring_pieces})")
    return p


def _check_int(name, value, low, high=None):
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise UsageError(f"--{name} {value}: must be {bound}")


def parse_args(argv, env=os.environ):
    """Parse and check every flag; raise UsageError (one line) before anything starts."""
    args = build_parser().parse_args(argv)
    _check_int("dp", args.dp, 1, 64)
    if under_torchrun(env):
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
    args.modes_given = args.modes is not None
    args.modes = [m for m in MODES if m in modes]  # always in the canonical order
    _check_halves(args)
    try:
        args.config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                  num_layers=args.layers, num_heads=args.heads,
                                  ffn_hidden_size=args.ffn, max_seq_len=args.seq,
                                  num_kv_heads=args.kv_heads,
                                  tie_embeddings=args.tie_embeddings,
                                  mlp=MODELS[args.model]["mlp"])
        _check_tp_divides_all(args.config, args.tp)
        args.config.check_tp_size(args.tp)
        if "dtensor" in args.modes:
            dtensor_tp.check_transformer_plan(args.config, args.tp)
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
    args.check_replicated_grads = _parse_check_replicated_grads(args.check_replicated_grads)
    _check_int("ring-pieces", args.ring_pieces, 1, 64)
    if args.ring_pieces > 1 and args.seq % (args.tp * args.ring_pieces):
        raise UsageError(f"--ring-pieces {args.ring_pieces} with --seq {args.seq} and --tp "
                         f"{args.tp}: each rank's {args.seq / args.tp:g} sequence rows must cut "
                         f"into {args.ring_pieces} equal pieces; use a --seq that is a multiple "
                         f"of {args.tp * args.ring_pieces}")
    args.wire, args.wire_rates = None, None
    if wire.is_model(args.link):
        args.wire = _check_wire(args, env)
        args.link = None
    args.link_rates = _check_link(args.link, args.device, args.dp, env)
    args.backend = _check_device(args.device, args.tp * args.dp, env)
    if args.nccl_high_priority and args.backend != "nccl":
        raise UsageError(f"--nccl-high-priority: this run uses {args.backend} on CPU; the flag "
                         f"sets NCCL's stream priority, use it with --device cuda")
    if args.threads is not None:
        _check_int("threads", args.threads, 1, 1024)
    _check_out(args.out)
    args.spec = ProfileSpec(
        config=args.config, model=args.model, tp=args.tp, dp=args.dp, steps=args.steps,
        warmup=args.warmup, batch=args.batch, seq=args.seq, lr=args.lr, dtype=args.dtype,
        seed=args.seed, modes=tuple(args.modes),
        threads=args.threads, bench_iters=args.bench_iters,
        bench_shape=args.bench_shape,
        timeline_iters=args.timeline_iters, check_replicated_grads=args.check_replicated_grads,
        trace_dir=os.path.abspath(args.out) if args.trace else None,
        ring_pieces=args.ring_pieces, wire=args.wire)
    return args


def _check_halves(args):
    """tp_halves needs a batch of 2 rows or more and a 1-D run: refused when named, dropped
    from the default modes otherwise."""
    why = None
    if args.dp > 1:
        why = (f"--dp {args.dp}: FSDP2 gathers each block's weights in the block's own forward, "
               f"which the two halves do not call; use --dp 1")
    elif args.batch < 2:
        why = f"--batch {args.batch}: two halves of the batch need --batch 2 or more"
    if why and "tp_halves" in args.modes:
        if args.modes_given:
            raise UsageError(f"--modes tp_halves with {why}, or leave tp_halves out of --modes")
        args.modes = [m for m in args.modes if m != "tp_halves"]


def _check_wire(args, env):
    """--link model:RATE: the wire's description; the modes it cannot carry refused (named)
    or, left to the default, dropped."""
    if args.dp > 1:
        raise UsageError(f"--link {args.link} with --dp {args.dp}: the modeled wire carries one "
                         f"TP group's transfers (FSDP2's do not cross it); use --dp 1")
    if args.device == "cuda":
        raise UsageError(f"--link {args.link}: the modeled wire stands in for a network between "
                         f"CPU ranks (gloo); it cannot be combined with --device cuda")
    try:
        args.wire_rates = wire.parse_rates(args.link)
    except ValueError as e:
        raise UsageError(str(e)) from None
    unseen = [m for m in args.modes if m in ("dtensor", "hf_dtensor")]
    if unseen and args.modes_given:
        raise UsageError(f"--link {args.link} with --modes {','.join(unseen)}: DTensor's "
                         f"collectives do not cross the modeled wire; leave them out of --modes")
    args.modes = [m for m in args.modes if m not in unseen]
    return args.wire_rates[0] if len(args.wire_rates) == 1 else None


def _check_hf_dtensor(config, tp):
    """What the hf_dtensor mode cannot run, as a ValueError, without building the model: the
    plan's checks on the sizes its LlamaConfig will have (run/hf_llama.py)."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("the hf_dtensor mode needs transformers (pip install -r "
                         "requirements.txt), or leave it out of --modes")
    dtensor_tp.check_hf_plan(types.SimpleNamespace(
        model_type="llama", tie_word_embeddings=config.tie_embeddings,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, intermediate_size=config.ffn_hidden_size,
        vocab_size=config.vocab_size, hidden_size=config.hidden_size), tp)


def _parse_check_replicated_grads(text):
    """"first" -> "first", "off" -> None, "N" -> N (a positive int)."""
    if text in ("first", "off"):
        return None if text == "off" else text
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--check-replicated-grads {text!r}: valid are first (after the first "
                         f"backward), off, or a positive number N (every N-th backward)")
    return int(text)


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
    if under_torchrun(env):
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
    local = int(env.get("LOCAL_WORLD_SIZE", ranks)) if under_torchrun(env) else ranks
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
