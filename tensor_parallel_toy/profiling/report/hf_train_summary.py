"""`run/hf_train.py`'s results and summary: per family and mode the step time and its ratios
with bootstrap 95 % intervals (paired by step, `metrics.ratio_interval`), saved activations
and bytes sent per rank, every step's loss against one device's, and issue 50's targets, each
met only when its whole interval is on the right side:

    ours TP+SP <= 0.75 x transformers' TP step, on the families whose transformers plan gathers
    inside a block (Phi-3's fused projections, OLMo 2's q/k/v);
    ours TP+SP against one device on those families no worse than on the Llama-like one:
    (ours / one device there) / (ours / one device on Llama) <= 1, one paired interval over
    the four step-time lists (every family runs in the same interleaved steps).
"""
import numpy as np
import torch

from ..measure.metrics import MiB, paired_interval, ratio_interval, summarize
from ..measure.transfers import ring_sent_bytes

MODES = ("one_device", "hf_tp", "ours_sp", "ours_no_sp")
MODE_NAMES = {"one_device": "one device", "hf_tp": "transformers TP", "ours_sp": "ours TP+SP",
              "ours_no_sp": "ours TP (no SP)"}
SAME_LOSS_RTOL = 1e-4
TARGET_VS_HF = 0.75  # ours_sp / hf_tp step, on the families whose plans gather
GATHERING = ("phi3", "olmo2")  # the families whose transformers plan gathers inside a block


def _interval_text(r):
    return f"{r['ratio']:.2f} [{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}]"


def summarize_runs(per_rank, labels, dims, steps):
    """hf_train.json's content from every rank's results (`run/hf_train.py`'s `_on_rank`);
    `labels`: {family: its name in the summary}, in the order run."""
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
    for family, label in labels.items():
        skipped = first["skipped"][family]
        entry = {"label": label, "skipped": skipped, "modes": {}, "ratios": {}}
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
