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
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from ...guards.collectives import barrier, reduce_numbers
from ...launcher.pool import WorkerPool
from ..measure.metrics import (MiB, SavedActivationBytes, keep_freed_memory, paired_interval,
                               ratio_interval, summarize)
from ..measure.transfers import DispatchedCollectives, recording, ring_sent_bytes
from ..report.output import write_text
from . import data
from .train import interleaved_order, make_optimizer

PROG = "python -m tensor_parallel_toy.profiling.run.hf_train"
# family: (transformers' config class, model class, label, what the family needs beyond dims)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", "Llama-like", {}),
            "phi3": ("Phi3Config", "Phi3ForCausalLM", "Phi-3-like", {"pad_token_id": 0}),
            "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "OLMo 2-like", {"pad_token_id": 0})}
MODES = ("one_device", "hf_tp", "ours_sp", "ours_no_sp")
MODE_NAMES = {"one_device": "one device", "hf_tp": "transformers TP", "ours_sp": "ours TP+SP",
              "ours_no_sp": "ours TP (no SP)"}
# Issue 50's dims: hidden 256, 4 layers, 8 heads / 4 k/v, batch 4 x 256 tokens, fp32.
DEFAULTS = dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=1024, vocab=512, batch=4, seq=256,
                steps=15)
SAME_LOSS_RTOL = 1e-4
TARGET_VS_HF = 0.75  # ours_sp / hf_tp step, on the families whose plans gather
GATHERING = ("phi3", "olmo2")  # the families whose transformers plan gathers inside a block


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


def train_step(model, optimizer, ids, measured=None):
    """One step: the model's own loss, backward, AdamW, zero_grad; returns the loss. With
    `measured` (a dict), the step is watched and what was seen is put in it."""
    if measured is None:
        loss = model(ids, labels=ids).loss
        loss.backward()
    else:
        entry_points, dispatched = _Counted(), DispatchedCollectives()
        with recording(entry_points), dispatched:
            with SavedActivationBytes(model) as saved:  # over the forward
                loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()  # inside: an optimizer that communicated would be counted
        optimizer.zero_grad(set_to_none=True)
        measured.update(saved_activation_bytes=saved.bytes, bytes=sum(dispatched.bytes.values()),
                        bytes_by_kind=dict(dispatched.bytes), calls_by_kind=dict(dispatched.calls),
                        unknown_collectives=sorted(dispatched.unknown),
                        entry_point_bytes=entry_points.bytes, entry_point_calls=entry_points.calls)
        optimizer.schedule.step()
        return loss.item()
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
                loss = train_step(model, optimizer, ids, out[pair]["measured"] if step == 0
                                  else None)
                seconds = time.perf_counter() - start
            finally:
                torch.set_num_threads(threads)
            out[pair]["loss"].append(loss)
            out[pair]["step_time_s"].append(seconds)
    # The slowest rank's time: a TP step is done when every rank is.
    slowest = reduce_numbers([t for pair in pairs for t in out[pair]["step_time_s"]], group,
                             dist.ReduceOp.MAX)
    for i, pair in enumerate(pairs):
        out[pair]["step_time_s"] = slowest[i * (steps + 1) + 1:(i + 1) * (steps + 1)]
    return {"rank": rank, "threads": threads, "one_device_threads": one_device_threads,
            "skipped": skipped, "runs": {f"{f}/{m}": v for (f, m), v in out.items()}}


def _interval_text(r):
    return f"{r['ratio']:.2f} [{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}]"


def summarize_runs(per_rank, families, dims, steps):
    """hf_train.json's content from every rank's results."""
    first = per_rank[0]
    results = {"tp": len(per_rank), "dims": dims, "dtype": "fp32", "timed_steps": steps,
               "warmup_steps": 1, "threads_per_rank": first["threads"],
               "one_device_threads": first["one_device_threads"], "torch": torch.__version__,
               "same_loss_rtol": SAME_LOSS_RTOL, "families": {}, "targets": []}
    try:
        import transformers
        results["transformers"] = transformers.__version__
    except ImportError:
        pass
    for family in families:
        skipped = first["skipped"][family]
        entry = {"label": FAMILIES[family][2], "skipped": skipped, "modes": {}, "ratios": {}}
        results["families"][family] = entry
        if "family" in skipped:
            continue
        one = first["runs"][f"{family}/one_device"]
        for mode in MODES:
            key = f"{family}/{mode}"
            if key not in first["runs"]:
                continue
            ranks = [r["runs"][key] for r in per_rank if mode != "one_device" or r["rank"] == 0]
            m = [r["measured"] for r in ranks]
            diffs = [max(abs(a - b) / abs(b) for a, b in zip(r["loss"], one["loss"]))
                     for r in ranks]
            entry["modes"][mode] = {
                "step_time_s": ranks[0]["step_time_s"],
                "step_time": summarize(ranks[0]["step_time_s"]), "loss": ranks[0]["loss"],
                "loss_max_rel_diff_vs_one_device": max(diffs),
                "saved_activation_bytes_per_rank": [x["saved_activation_bytes"] for x in m],
                "bytes_per_step_per_rank": [x["bytes"] for x in m],
                "ring_sent_bytes_per_step_per_rank": [ring_sent_bytes(x["bytes_by_kind"],
                                                                      len(per_rank)) for x in m],
                "bytes_by_kind_rank0": m[0]["bytes_by_kind"],
                "calls_by_kind_rank0": m[0]["calls_by_kind"],
                "entry_point_bytes_per_rank": [x["entry_point_bytes"] for x in m],
                "unknown_collectives": sorted({u for x in m for u in x["unknown_collectives"]})}
        times = {mode: v["step_time_s"] for mode, v in entry["modes"].items()}
        for mode in times:
            if mode != "one_device":
                entry["ratios"][f"{mode}/one_device"] = ratio_interval(times[mode],
                                                                       times["one_device"])
        if "hf_tp" in times:
            for mode in ("ours_sp", "ours_no_sp"):
                entry["ratios"][f"{mode}/hf_tp"] = ratio_interval(times[mode], times["hf_tp"])
    results["losses_agree"] = all(
        v["loss_max_rel_diff_vs_one_device"] <= SAME_LOSS_RTOL
        for e in results["families"].values() for v in e["modes"].values())
    results["targets"] = targets(results)
    return results


def _relative(a, b, c, d):
    """(median a / median b) / (median c / median d), along the last axis."""
    return (np.median(a, axis=-1) / np.median(b, axis=-1)) / (np.median(c, axis=-1)
                                                              / np.median(d, axis=-1))


def targets(results):
    """Issue 50's targets, each met only when its whole 95 % interval is on the right side."""
    fams, out = results["families"], []
    llama = fams.get("llama", {}).get("modes", {})
    for family in GATHERING:
        entry = fams.get(family)
        if entry is None:
            continue
        name = f"ours TP+SP <= {TARGET_VS_HF} x transformers' TP step on the {entry['label']} model"
        ratio = entry["ratios"].get("ours_sp/hf_tp")
        out.append(_verdict(name, ratio, TARGET_VS_HF, entry))
        name = (f"ours TP+SP against one device on the {entry['label']} model no worse than on "
                f"the Llama-like one (the ratio of the two ratios <= 1)")
        modes = entry["modes"]
        ratio = None
        if {"ours_sp", "one_device"} <= set(modes) and {"ours_sp", "one_device"} <= set(llama):
            ratio = paired_interval(_relative, [modes["ours_sp"]["step_time_s"],
                                                modes["one_device"]["step_time_s"],
                                                llama["ours_sp"]["step_time_s"],
                                                llama["one_device"]["step_time_s"]])
        out.append(_verdict(name, ratio, 1.0, entry))
    return out


def _verdict(name, ratio, limit, entry):
    if ratio is None:
        why = ("the model was skipped (above)" if "family" in entry["skipped"] else
               next(iter(entry["skipped"].values()), "the modes it compares did not run"))
        return {"target": name, "limit": limit, "met": None, "why": why}
    return {"target": name, "limit": limit, "ratio": ratio, "met": ratio["ci95"][1] <= limit}


def report(results):
    """The summary table and the verdicts, as printed and saved."""
    d, p = results["dims"], results["tp"]
    lines = [f"hf_train: Hugging Face decoders trained by their own TP plan, TP {p} on CPU/gloo; "
             f"hidden {d['hidden']}, {d['layers']} layers, {d['heads']} heads ({d['kv_heads']} "
             f"k/v), MLP {d['ffn']}, vocab {d['vocab']}, batch {d['batch']} x {d['seq']} tokens, "
             f"fp32; {results['timed_steps']} timed steps after 1 warm-up, interleaved; "
             f"{results['threads_per_rank']} thread(s) per rank, one device "
             f"{results['one_device_threads']}",
             f"  {'model':<12} {'mode':<16} {'step ms':>8} {'/ one device [95%]':>19} "
             f"{'/ transformers TP':>18} {'act MiB/rank':>12} {'MiB sent/step/rank':>18} "
             f"{'loss rel diff':>13}"]
    notes = []
    for family, entry in results["families"].items():
        if "family" in entry["skipped"]:
            notes.append(f"  {entry['label']} skipped: {entry['skipped']['family']}")
            continue
        for mode, v in entry["modes"].items():
            vs_one = entry["ratios"].get(f"{mode}/one_device")
            vs_hf = entry["ratios"].get(f"{mode}/hf_tp")
            lines.append(
                f"  {entry['label']:<12} {MODE_NAMES[mode]:<16} "
                f"{v['step_time']['median'] * 1e3:>8.1f} "
                f"{_interval_text(vs_one) if vs_one else '1':>19} "
                f"{_interval_text(vs_hf) if vs_hf else '-':>18} "
                f"{max(v['saved_activation_bytes_per_rank']) / MiB:>12.1f} "
                f"{max(v['ring_sent_bytes_per_step_per_rank']) / MiB:>18.2f} "
                f"{v['loss_max_rel_diff_vs_one_device']:>13.1e}")
            if v["unknown_collectives"]:
                notes.append(f"  {entry['label']} {MODE_NAMES[mode]}: collectives not counted: "
                             f"{', '.join(v['unknown_collectives'])}")
        for mode, why in entry["skipped"].items():
            notes.append(f"  {entry['label']}: {MODE_NAMES.get(mode, mode)} not run: {why}")
        hf = entry["modes"].get("hf_tp")
        if hf:
            seen, total = max(hf["entry_point_bytes_per_rank"]), max(hf["bytes_per_step_per_rank"])
            notes.append(f"  {entry['label']}: of the {total / MiB:.2f} MiB per step transformers' "
                         f"TP puts into collectives, torch.distributed's entry points see "
                         f"{seen / MiB:.2f} MiB (the rest goes through DTensor's functional "
                         f"collectives)")
    lines += notes
    lines.append("  sent: the bytes a rank sends in one step if a ring carries each collective, "
                 "counted at PyTorch's dispatcher; act: tensors saved for backward over one "
                 "forward")
    for t in results["targets"]:
        if t["met"] is None:
            lines.append(f"  target not measured: {t['target']}: {t['why']}")
        else:
            lines.append(f"  target {'met' if t['met'] else 'MISSED'}: {t['target']}: "
                         f"{_interval_text(t['ratio'])}")
    worst = max((v["loss_max_rel_diff_vs_one_device"] for e in results["families"].values()
                 for v in e["modes"].values()), default=0.0)
    lines.append(f"  losses: every mode within {SAME_LOSS_RTOL:g} relative of one device's at "
                 f"every step: {'yes' if results['losses_agree'] else 'NO'} (largest {worst:.1e})")
    return "\n".join(lines)


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
            per_rank = pool.run(_on_rank, families, dims, args.steps, args.lr, args.seed, folder)
    finally:
        if owned:
            pool.close()
    results = summarize_runs(per_rank, families, dims, args.steps)
    results["command"] = " ".join([PROG, *(sys.argv[1:] if argv is None else argv)])
    text = report(results)
    os.makedirs(args.out, exist_ok=True)
    write_text(os.path.join(args.out, "hf_train.json"), json.dumps(results, indent=1) + "\n")
    write_text(os.path.join(args.out, "summary.txt"), text + "\n")
    print(text)
    return 0 if results["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
