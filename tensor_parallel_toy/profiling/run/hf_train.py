"""`python -m tensor_parallel_toy.profiling.run.hf_train`: Hugging Face decoders trained by their
own TP plan, ours beside `transformers`' own TP, on CPU ranks (gloo).

For each family (default Llama-, Phi-3- and OLMo 2-like; random weights from a config, nothing
downloaded) rank 0 saves one random model with `save_pretrained`, and four modes load it:

    one_device  the model on rank 0 alone, with as many threads as the ranks have together
                (TP 2 of 1 thread each: 2), the other ranks idle
    hf_tp       transformers' own TP: `from_pretrained(..., tp_plan="auto")` as `hf_tp.load_tp`
                starts it (its plan's strings, no sequence parallelism; Phi-3's fused
                projections and OLMo 2's q/k/v gathered on every rank)
    ours_sp     `parallelize_module(model, group, hf_plan(model, tp_size=p))`: TP + SP, the
                fused projections split by their layout, the package's guards on (default)
    ours_no_sp  the same with `hf_plan(..., sequence_parallel=False)`: classic TP

A step is the model's own loss (`model(ids, labels=ids).loss`, logits whole in every mode),
backward, AdamW (`train.make_optimizer`) and zero_grad, on the harness's corpus
(`data.batch`: every mode and rank the same batch). Every (family, mode) pair runs step k
before any runs step k + 1, in an order rotated each step (`train.interleaved_order`), so load
from other work lands on all alike and step k of any two pairs is a paired sample
(`metrics.ratio_interval`). Step 0 is a warm-up, not timed, and measured instead, per rank:
- the activations saved for backward over its forward (`metrics.SavedActivationBytes`);
- the bytes each rank puts into collectives over the whole step, counted at PyTorch's
  dispatcher (`transfers.DispatchedCollectives`: torch.distributed's collectives and DTensor's
  functional ones alike), and, beside it, what torch.distributed's entry points alone see
  (`transfers.recording`), which misses DTensor's. The summary gives them as a ring would send
  them (`transfers.ring_sent_bytes`: an all-reduce of N bytes sends 2(p-1)/p N, an all-gather
  (p-1) times its shard), so an all-reduce and its reduce-scatter + all-gather compare.
A timed step runs from a barrier to the end of the optimizer step; its time is the slowest
rank's. Every mode's loss must equal one device's within 1e-4 relative at every step.

The summary gives per family and mode the median step, each TP mode over one device and ours
over transformers' TP with bootstrap 95 % intervals, and issue 50's targets: ours (TP + SP) at
most 0.75 x transformers' TP step on the Phi-3- and OLMo 2-like models, and ours against one
device no worse there than on the Llama-like model; met only when the whole interval is on
the right side. A family `hf_plan` refuses is skipped with its one-line reason; where
transformers' TP cannot load a model, one line says so and the rest runs.
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ...guards.collectives import barrier, reduce_numbers
from ...launcher.pool import WorkerPool
from ..measure.metrics import SavedActivationBytes, keep_freed_memory
from ..measure.transfers import DispatchedCollectives, recording
from ..report.hf_train_summary import MODES, report, summarize_runs
from ..report.output import write_text
from . import data
from .train import interleaved_order, make_optimizer

PROG = "python -m tensor_parallel_toy.profiling.run.hf_train"
# family: (transformers' config class, model class, label, what the family needs beyond dims)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", "Llama-like", {}),
            "phi3": ("Phi3Config", "Phi3ForCausalLM", "Phi-3-like", {"pad_token_id": 0}),
            "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "OLMo 2-like", {"pad_token_id": 0})}
# Issue 50's dims: hidden 256, 4 layers, 8 heads / 4 k/v, batch 4 x 256 tokens, fp32.
DEFAULTS = dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=1024, vocab=512, batch=4, seq=256,
                steps=15)


def hf_config(family, dims):
    """The family's transformers config at `dims` (no dropout, untied head)."""
    import transformers

    config_cls, _, _, extra = FAMILIES[family]
    return getattr(transformers, config_cls)(
        vocab_size=dims["vocab"], hidden_size=dims["hidden"], intermediate_size=dims["ffn"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"], max_position_embeddings=dims["seq"],
        tie_word_embeddings=False, attention_dropout=0.0, **extra)


def save_random_model(family, dims, folder, seed):
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(hf_config(family, dims))
    model.save_pretrained(folder)


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()


def _ours(folder, group, sequence_parallel):
    from ...apply import parallelize_module
    from ...interop.hf_plan import hf_plan

    model = _load(folder)
    plan = hf_plan(model, sequence_parallel=sequence_parallel, tp_size=dist.get_world_size(group))
    return parallelize_module(model, group, plan)


def _agreed_failure(group, error):
    """The same answer on every rank: whether any rank failed (then this rank's reason)."""
    failed = reduce_numbers([error is not None], group, dist.ReduceOp.MAX)[0]
    return (str(error).strip().splitlines() or ["(no message)"])[0] if failed else None


def build_modes(family, folder, group, lr):
    """{mode: (model, optimizer)} on this rank (one_device on rank 0 only), and {mode or
    "family": one-line reason} for what could not be built; the same decisions on every rank."""
    from ...interop.hf_plan import hf_plan
    from . import hf_tp

    why = None
    try:  # hf_plan only reads the model: a refusal is the same on every rank, and no collective
        hf_plan(_load(folder), tp_size=dist.get_world_size(group))
    except ValueError as e:
        why = e
    reason = _agreed_failure(group, why)
    if reason:
        return {}, {"family": f"hf_plan refuses it: {reason}"}
    models, skipped = {}, {}
    if dist.get_rank() == 0:
        models["one_device"] = _load(folder)
    error = None
    try:
        models["hf_tp"] = hf_tp.load_tp(folder).train()
    except Exception as e:  # noqa: BLE001 - any failure of transformers' TP is reported, not fatal
        error = e
    reason = _agreed_failure(group, error)
    if reason:
        models.pop("hf_tp", None)
        skipped["hf_tp"] = f"transformers' TP cannot load it on CPU/gloo: {reason}"
    models["ours_sp"] = _ours(folder, group, sequence_parallel=True)
    models["ours_no_sp"] = _ours(folder, group, sequence_parallel=False)
    return {m: (model, make_optimizer(model, lr)) for m, model in models.items()}, skipped


class _Counted:
    """A recorder for `transfers.recording`: the bytes this rank put in, and how many calls."""

    def __init__(self):
        self.calls, self.bytes = 0, 0

    def transfer(self, kind, nbytes, post):
        self.calls, self.bytes = self.calls + 1, self.bytes + nbytes
        return post()


class Watch(contextlib.ExitStack):
    """`with Watch(model) as w:` around a step, then `w.seen()`: the activations saved for
    backward, and the bytes this rank put into collectives, counted at the dispatcher and at
    torch.distributed's entry points (see the module docstring)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def __enter__(self):
        super().__enter__()
        self.entry_points = self.enter_context(recording(_Counted()))
        self.dispatched = self.enter_context(DispatchedCollectives())
        self.saved = self.enter_context(SavedActivationBytes(self.model))
        return self

    def seen(self):
        d = self.dispatched
        return {"saved_activation_bytes": self.saved.bytes, "bytes": sum(d.bytes.values()),
                "bytes_by_kind": dict(d.bytes), "calls_by_kind": dict(d.calls),
                "unknown_collectives": sorted(d.unknown),
                "entry_point_bytes": self.entry_points.bytes,
                "entry_point_calls": self.entry_points.calls}


def train_step(model, optimizer, ids, watch=None):
    """One step: the model's own loss, backward, AdamW, zero_grad; returns the loss. `watch`,
    if given, is entered around the forward, the backward and the optimizer's step (one that
    communicated would be counted)."""
    with watch or contextlib.nullcontext():
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
    optimizer.schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _on_rank(families, dims, steps, lr, seed, folder):
    """On every rank: every family's modes trained side by side, interleaved step by step."""
    from transformers.utils import logging as hf_logging

    group, rank = dist.group.WORLD, dist.get_rank()
    keep_freed_memory()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its loading bars and config warnings, once per rank
    hf_logging.disable_progress_bar()
    try:
        return _train_all(families, dims, steps, lr, seed, folder, group, rank)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _train_all(families, dims, steps, lr, seed, folder, group, rank):
    threads = torch.get_num_threads()
    one_device_threads = threads * dist.get_world_size(group)
    runs, skipped = {}, {}
    for family in families:
        path = os.path.join(folder, family)
        if rank == 0:
            save_random_model(family, dims, path, seed)
        barrier(group)
        built, skipped[family] = build_modes(family, path, group, lr)
        runs.update({(family, mode): run for mode, run in built.items()})
    # The pairs every rank steps through, in the same order (one_device: rank 0 only).
    pairs = [(f, m) for f in families for m in MODES
             if m not in skipped[f] and "family" not in skipped[f]]
    out = {pair: {"loss": [], "step_time_s": [], "measured": {}} for pair in pairs}
    corpus = data.make_corpus(seed=seed)
    for step in range(steps + 1):  # step 0: warm-up, measured, not timed
        ids, _ = data.batch(corpus, step, dims["batch"], dims["seq"], seed)
        for pair in interleaved_order(pairs, step):
            if pair not in runs:
                out[pair]["step_time_s"].append(0.0)  # one device, on rank 0 alone
                continue
            model, optimizer = runs[pair]
            alone = pair[1] == "one_device"
            torch.set_num_threads(one_device_threads if alone else threads)
            try:
                if not alone:
                    barrier(group)
                start = time.perf_counter()
                watch = Watch(model) if step == 0 else None
                loss = train_step(model, optimizer, ids, watch)
                seconds = time.perf_counter() - start
            finally:
                torch.set_num_threads(threads)
            if watch is not None:
                out[pair]["measured"] = watch.seen()
            out[pair]["loss"].append(loss)
            out[pair]["step_time_s"].append(seconds)
    # The slowest rank's time: a TP step is done when every rank is.
    slowest = reduce_numbers([t for pair in pairs for t in out[pair]["step_time_s"]], group,
                             dist.ReduceOp.MAX)
    for i, pair in enumerate(pairs):
        out[pair]["step_time_s"] = slowest[i * (steps + 1) + 1:(i + 1) * (steps + 1)]
    return {"rank": rank, "threads": threads, "one_device_threads": one_device_threads,
            "skipped": skipped, "runs": {f"{f}/{m}": v for (f, m), v in out.items()}}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2, before any rank starts
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse(argv):
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated, of {', '.join(FAMILIES)}; default all")
    for name, value in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                       help=f"default {value}" + (" (timed, after 1 warm-up)" if name == "steps"
                                                  else ""))
    p.add_argument("--tp", type=int, default=2, help="TP size (ranks); default 2")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("results", "hf_train"),
                   help="folder for hf_train.json and summary.txt")
    args = p.parse_args(argv)
    families = args.families.split(",")
    problems = [f"--families {args.families!r}: give names of {', '.join(FAMILIES)}"
                if not set(families) <= set(FAMILIES) or not families else "",
                f"--steps {args.steps}: must be 2 or more (the intervals)" if args.steps < 2 else "",
                f"--tp {args.tp}: must be 2 or more" if args.tp < 2 else "",
                f"--heads {args.heads}, --kv-heads {args.kv_heads}: both must be multiples of "
                f"--tp {args.tp}" if args.heads % args.tp or args.kv_heads % args.tp else "",
                f"--seq {args.seq}: must be a multiple of --tp {args.tp} (sequence parallelism)"
                if args.seq % args.tp else "",
                f"--hidden {args.hidden}: must be a multiple of --heads {args.heads}"
                if args.hidden % args.heads else ""]
    if any(problems):
        p.error(next(x for x in problems if x))
    return args, families


def main(argv=None, pool=None):
    args, families = parse(argv)
    dims = {name: getattr(args, name) for name in DEFAULTS if name != "steps"}
    owned = pool is None
    pool = pool or WorkerPool(args.tp)
    try:
        with tempfile.TemporaryDirectory(prefix="hf_train-") as folder:
            # The whole run is one task: the pool's default limit (twice a collective's) would
            # stop a long one; a hung collective still fails after its own timeout.
            per_rank = pool.run(_on_rank, families, dims, args.steps, args.lr, args.seed, folder,
                                timeout_s=3600)
    finally:
        if owned:
            pool.close()
    results = summarize_runs(per_rank, {f: FAMILIES[f][2] for f in families}, dims, args.steps)
    results["command"] = " ".join([PROG, *(sys.argv[1:] if argv is None else argv)])
    text = report(results)
    os.makedirs(args.out, exist_ok=True)
    write_text(os.path.join(args.out, "hf_train.json"), json.dumps(results, indent=1) + "\n")
    write_text(os.path.join(args.out, "summary.txt"), text + "\n")
    print(text)
    return 0 if results["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
