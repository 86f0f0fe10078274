"""The profile's targets, checked against measured numbers: each verdict with its shortfall and,
when missed, a reason read from other measured numbers (the overlap benchmark's ceilings, the
timeline's blocked time, the block's limit and the rings' ceiling, the growth of the loss
difference), never a guess. The targets themselves, their bounds and their texts, are data:
targets.json, beside this file; `evaluate_targets(results)` gives results.json's `targets`.
"""
import json
import os

from .landing import block_budget

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets.json"),
          encoding="utf-8") as _f:
    TARGETS = json.load(_f)


def _ratio(results, a, b):
    return results.get("ratios", {}).get(f"{a}/{b}")


def fmt_ratio(r):
    """A step-time ratio of results.json as `median [95% low-high]`."""
    return f"{r['ratio']:.3f} [95% {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}]"


def fmt_spread(d, digits=2):
    """A distribution (metrics.summarize) as `median [p10-p90]`."""
    return f"{d['median']:.{digits}f} [{d['p10']:.{digits}f}-{d['p90']:.{digits}f}]"


def _written(number):
    """A bound as a target's text prints it: as Python writes it, but a small power of ten the
    short way (1e-4, not 0.0001)."""
    short = f"{number:.0e}".replace("e-0", "e-")
    return short if 0 < number < 1e-3 and float(short) == number else repr(number)


def target_text(name):
    """targets.json's text of target `name`, its numbers filled in."""
    target = TARGETS[name]
    return target["text"].format(**{k: _written(v) for k, v in target.items()
                                    if isinstance(v, (int, float))})


def _target(name, measured, met, short_by, reason=None, note=None, interval=None):
    """met: True, False, or None when the run cannot decide (wrong dtype, unusable timings,
    a target that only applies on an emulated link)."""
    return {"name": name, "measured": measured, "interval": interval, "met": met,
            "short_by": short_by, "reason": None if met else reason, "note": note}


def _saves(ms):
    """A time difference with the sign in the verb: 'saves 0.42 ms' or 'costs 0.26 ms'."""
    return f"{'saves' if ms >= 0 else 'costs'} {abs(ms):.2f} ms"


def _overlap_gain_note(bench):
    """Where tp_overlap's per-op gain over tp comes from, summed over the four ops:
    the transport (gloo collectives -> ring P2P) and the overlap itself."""
    ops = bench["ops"].values()
    transport = sum(o["t_basic_ms"] - o["t_seq_ms"] for o in ops)
    overlap = sum(o["t_seq_ms"] - o["t_overlap_ms"] for o in ops)
    return (f"per-op benchmark, summed over the four ops: replacing gloo's collectives by the "
            f"ring's P2P transfers (basic -> sequential) {_saves(transport)}, overlapping "
            f"them with the GEMMs (sequential -> overlapped) {_saves(overlap)}")


def _hidden_note(op):
    """The overlapped op against the sequential run and against its parts alone, in ms saved
    or lost, then as the share of min(comm, GEMM) hidden (negative when overlap cost time)."""
    seq, parts, t = op["t_seq_ms"], op["t_comm_ms"] + op["t_gemm_ms"], op["t_overlap_ms"]
    second = _saves(parts - t)
    if (seq >= t) == (parts >= t):  # one verb for both
        second = second.split(" ", 1)[1]
    note = (f"the overlapped op ({t:.2f} ms) {_saves(seq - t)} against the sequential run "
            f"({seq:.2f} ms) and {second} against comm + GEMM alone ({parts:.2f} ms): hidden {op['hidden']:.0%} and {op['hidden_vs_parts']:.0%} of min(comm, GEMM)"
            + (", negative: overlap cost time" if min(op["hidden"], op["hidden_vs_parts"]) < 0
               else ""))
    blocks = op.get("overlap_over_max_blocks")
    if blocks is None:  # results written before the spread over blocks was measured
        return note
    return (f"per block of {blocks['rounds_per_block']} rounds: {fmt_spread(blocks)} "
            f"(median [p10-p90] of {blocks['n']}); " + note)


def evaluate_targets(results):
    """The benchmark targets: measured value, met or not, shortfall, measured reason. Each
    function below checks one target and returns None when this run has nothing to check it on."""
    checks = (_overlapped_op_target, _overlap_vs_tp_target, _halves_vs_tp_target,
              _overlap_vs_dtensor_target, _loss_target)
    return [t for t in (check(results) for check in checks) if t is not None]


def _run_kind(results):
    """(link, gpu): the run's emulated link (or None) and whether it ran on CUDA."""
    return results["meta"].get("link"), results["meta"]["device"] == "cuda"


def _overlapped_op_target(results):
    """Forward AG+GEMM overlapped / max(comm, GEMM) against its bound (`overlapped_op`), where
    the wire is the bottleneck."""
    bench = results.get("overlap_benchmark")
    if not bench:
        return None
    link, gpu = _run_kind(results)
    op = bench["ops"]["column_fwd"]
    measured, limit = op["overlap_over_max"], TARGETS["overlapped_op"]["bound"]
    met = measured <= limit if link or gpu else None
    # A part cannot take longer than the sequential run that contains it, beyond noise.
    consistent = max(op["t_comm_ms"], op["t_gemm_ms"]) <= 1.1 * op["t_seq_ms"]
    why = (f"schedule ceiling {op['schedule_ceiling']:.0%} of the hideable time (comm/GEMM "
           f"= {op['comm_over_gemm']:.2f} at p={bench['shape']['p']})")
    if "cpu_ceiling" in op:
        why += (f"; CPU ceiling {op['cpu_ceiling']:.0%}: a {op['t_comm_ms']:.2f} ms transfer "
                f"costs each rank {op['comm_cpu_ms']:.2f} ms of CPU, "
                f"{op['comm_cpu_posting_thread_ms']:.2f} ms of it in the posting thread, "
                f"the rest on a core that also runs a rank's GEMM")
    if gpu:
        why += ("; on a GPU NCCL's kernels take SMs and memory bandwidth from the GEMM they "
                "run beside, so the overlapped GEMM is slower than the GEMM alone")
    elif not link:
        why = ("not a target on loopback: a transfer there is CPU work on the cores that run "
               "the GEMMs, not time on a wire (run with --link to measure it)")
    elif not consistent:
        met, why = None, (
            f"not measurable here: a part took longer than the sequential run that contains "
            f"it (comm alone {op['t_comm_ms']:.2f} ms, GEMM alone {op['t_gemm_ms']:.2f} ms, "
            f"sequential {op['t_seq_ms']:.2f} ms); the ranks share cores or other work "
            f"loads the machine")
    return _target(target_text("overlapped_op"), measured,
                   met, None if met in (True, None) else measured - limit, why, _hidden_note(op))


def _overlap_vs_tp_target(results):
    """tp_overlap / tp: on the link its median and interval's top against `overlap_vs_tp_link`;
    on loopback the interval's top against `overlap_vs_tp_loopback`."""
    return _faster_than_tp_target(results, "tp_overlap", "overlap_vs_tp_link",
                                  "overlap_vs_tp_loopback", _rings_why)


def _halves_vs_tp_target(results):
    """tp_halves / tp on the link against `halves_vs_tp_link` (loopback: only reported)."""
    return _faster_than_tp_target(results, "tp_halves", "halves_vs_tp_link", None, _halves_why)


def _faster_than_tp_target(results, mode, on_link, on_loopback, why):
    r = _ratio(results, mode, "tp")
    link, gpu = _run_kind(results)
    if r is None or not (link or on_loopback):
        return None
    low, high = r["ci95"]
    if link:
        median_limit = TARGETS[on_link]["median"]
        high_limit = TARGETS[on_link]["interval_top"]
        name = target_text(on_link)
        met = r["ratio"] <= median_limit and high < high_limit
        short = max(r["ratio"] - median_limit, high - high_limit)
    else:
        limit = TARGETS[on_loopback]["bound"]
        name = target_text(on_loopback)
        met, short = high <= limit, high - limit
    bench = results.get("overlap_benchmark")
    note = (f"{fmt_ratio(r)}; " + _overlap_gain_note(bench) if bench and mode == "tp_overlap"
            else fmt_ratio(r))
    return _target(name, r["ratio"], met, None if met else short, why(results, gpu), note,
                   interval=r["ci95"])


def _rings_why(results, gpu):
    """The timeline's account of tp_overlap against tp, or None without one."""
    tl = results.get("timeline")
    if not tl:
        return None
    t, o = (tl["summary"][m]["over_recordings"] for m in ("tp", "tp_overlap"))
    tp = block_budget(tl)
    total, blocked = tp["total_ms"], tp["comm_ms"]
    who = "the compute stream stalled" if gpu else "the host blocked"
    why = (f"timeline of one block, medians over {t['total_ms']['n']} recordings "
           f"(slowest rank): tp {total:.1f} ms, {who} {blocked:.1f} ms waiting for "
           f"communication (hiding all of it would give {(total - blocked) / total:.2f}"
           f" x tp); tp_overlap {o['total_ms']['median']:.1f} ms, still "
           f"{o['blocked_in_comm_ms']['median']:.1f} ms"
           + ("" if gpu else f", and posting {o['posting_ms']['median']:.1f} ms"))
    if tp["gemm_ms"]:  # the ring hides a transfer only under the GEMMs of its own layer
        why += (f"; the rings hide a transfer only under its own layer's GEMMs, "
                f"{tp['gemm_ms']:.1f} ms of tp's block: at best {tp['ring_ceiling']:.2f} x tp")
    return why


def _halves_why(results, gpu):
    land = results.get("landing") or {}
    if "limit" not in land:
        return None
    why = (f"the limit of any schedule of tp's transfers is {land['limit']:.2f} x tp "
           f"(max(comm, compute) / (comm + compute) of tp's block: "
           f"{land['comm_ms']:.1f} ms waiting, {land['compute_ms']:.1f} ms computing)")
    if "tp_passes" in land:  # the forward carries half the transfers and a third of the compute
        f, b = land["tp_passes"]["forward"], land["tp_passes"]["backward"]
        why += (f"; tp's block waits {f['wait_ms']:.1f} ms for transfers in the forward against "
                f"{f['compute_ms']:.1f} ms of compute there ({b['wait_ms']:.1f} against "
                f"{b['compute_ms']:.1f} in the backward): where the forward's transfers take as "
                f"long as its compute, the other half has too little to hide them under; and "
                f"each pass's first and last transfers have no other half beside them")
    return why


def _overlap_vs_dtensor_target(results):
    """tp_overlap / dtensor, its whole interval against `overlap_vs_dtensor`."""
    r = _ratio(results, "tp_overlap", "dtensor")
    if r is None:
        return None
    limit = TARGETS["overlap_vs_dtensor"]["bound"]
    met = r["ci95"][1] <= limit
    tp_vs_dt, overlap_vs_tp = _ratio(results, "tp", "dtensor"), _ratio(results, "tp_overlap", "tp")
    note = None if tp_vs_dt is None or overlap_vs_tp is None else (
        f"tp_overlap / dtensor = (tp_overlap / tp) x (tp / dtensor) = "
        f"{overlap_vs_tp['ratio']:.2f} x {tp_vs_dt['ratio']:.2f}")
    return _target(target_text("overlap_vs_dtensor"),
                   r["ratio"], met, None if met else r["ci95"][1] - limit, note,
                   fmt_ratio(r), interval=r["ci95"])


def _loss_target(results):
    """Per-step loss of every TP mode against the baseline's, relative (`loss_vs_baseline`,
    fp32 runs)."""
    modes = results["modes"]
    errors = {m: max(d["loss_rel_err_vs_baseline"]) for m, d in modes.items()
              if "loss_rel_err_vs_baseline" in d}
    if not errors:
        return None
    worst_mode = max(errors, key=errors.get)
    worst = errors[worst_mode]
    tolerance = TARGETS["loss_vs_baseline"]["relative_error"]
    fp32 = results["config"]["run"]["dtype"] == "fp32"
    met = worst <= tolerance if fp32 else None
    why = None
    if fp32 and not met:
        errs = modes[worst_mode]["loss_rel_err_vs_baseline"]
        first = next(i for i, e in enumerate(errs) if e > tolerance)
        why = (f"{worst_mode}: {errs[0]:.1e} at step 0, first above {_written(tolerance)} at "
               f"step {first}: fp32 round-off of a different summation order, amplified by "
               f"training")
    return _target(target_text("loss_vs_baseline")
                   + ("" if fp32 else " (checked in fp32 only; this run is not fp32)"),
                   worst, met, None if met in (True, None) else worst - tolerance, why)
