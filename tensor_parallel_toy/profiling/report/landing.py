"""Where each mode lands between tp and the limit of any schedule, from measured numbers.

From tp's block in the timeline (the median recording's numbers, slowest rank; whole
collectives, so the host waits for every transfer): comm = the time it sat waiting for
transfers, compute = the rest of the block. Then, as fractions of tp's time:

- the limit of any schedule: max(comm, compute) / (comm + compute); a schedule that hid every
  transfer under some compute would reach it (and no schedule of these transfers beats it);
- the rings' GEMM ceiling: a ring hides a transfer only under GEMMs (its own layer's), so at
  best min(comm, GEMMs) of the block is hidden: (total - min(comm, GEMMs)) / total. Pooled over
  the block's layers, it is a loose bound: layer by layer, min(comm_l, GEMM_l) summed, the rings
  hide less (the post's figure ceiling_vs_limit.png draws the difference).

Each mode is then placed by its step-time ratio to tp (training steps, no recorder: the numbers
the targets use) and by its block in the timeline. Both are fractions of tp: the limit and the
ceiling are the block's, applied to a step that also holds the embedding, head, loss and
optimizer, so they are estimates; "of the way" = (1 - ratio) / (1 - limit), the share of what
any schedule could save that the mode saved.
"""


def block_budget(timeline):
    """{total, comm, compute, gemm (ms), limit, ring_ceiling} from tp's block, or None."""
    tp = (timeline or {}).get("summary", {}).get("tp")
    if not tp or "over_recordings" not in tp:
        return None
    total = tp["over_recordings"]["total_ms"]["median"]
    comm = tp["over_recordings"]["blocked_in_comm_ms"]["median"]
    gemm = max((r.get("gemm_ms", 0.0) for r in tp["per_rank"]), default=0.0)
    compute = total - comm
    return {"total_ms": total, "comm_ms": comm, "compute_ms": compute, "gemm_ms": gemm,
            "limit": max(comm, compute) / total, "ring_ceiling": (total - min(comm, gemm)) / total}


def passes(spans):
    """One rank's recording of a block -> {"forward", "backward": {"wait_ms", "compute_ms"}}:
    the time blocked in waits and the rest, on each side of the forward's end."""
    end = max(s["end"] for s in spans if s["kind"] == "end")
    turn = next(s["start"] for s in spans if s["kind"] == "forward_end")
    out = {}
    for name, (a, b) in (("forward", (0.0, turn)), ("backward", (turn, end))):
        wait = sum(s["end"] - s["start"] for s in spans
                   if s["kind"] == "wait" and a <= s["start"] < b)
        out[name] = {"wait_ms": wait, "compute_ms": (b - a) - wait}
    return out


def landing(results):
    """results.json's `landing`: the block's budget and, per mode, its step and block ratio to
    tp and the share of the way from tp to the limit; None without a timeline."""
    budget = block_budget(results.get("timeline"))
    if budget is None:
        return None
    summary, tp_block = results["timeline"]["summary"], budget["total_ms"]
    modes = {}
    for mode in ("tp_overlap", "tp_halves"):
        step = results.get("ratios", {}).get(f"{mode}/tp")
        if step is None:
            continue
        block = summary.get(mode, {}).get("over_recordings", {}).get("total_ms", {})
        modes[mode] = {"step": step, "block": block["median"] / tp_block if block else None,
                       "of_the_way": (1 - step["ratio"]) / (1 - budget["limit"])}
    tp_spans = results["timeline"].get("spans", {}).get("tp")
    split = passes(tp_spans[0]) if tp_spans else None  # rank 0's drawn recording
    return {**budget, "modes": modes, **({"tp_passes": split} if split else {})}


def landing_lines(land):
    if not land:
        return []
    lines = [f"where the modes land against tp (tp's block in the timeline: {land['total_ms']:.1f}"
             f" ms = {land['comm_ms']:.1f} ms waiting for transfers + {land['compute_ms']:.1f} ms "
             f"of compute, {land['gemm_ms']:.1f} ms of it GEMMs):",
             f"  {'limit of any schedule':<24} max(comm, compute) / (comm + compute) = "
             f"{land['limit']:.2f} x tp",
             f"  {'rings GEMM ceiling':<24} (block - min(comm, GEMMs)) / block = "
             f"{land['ring_ceiling']:.2f} x tp"]
    for mode, m in land["modes"].items():
        r = m["step"]
        block = f", block {m['block']:.2f} x tp" if m["block"] is not None else ""
        lines.append(f"  {mode:<24} step {r['ratio']:.3f} [95% {r['ci95'][0]:.3f}-"
                     f"{r['ci95'][1]:.3f}] x tp{block}: {m['of_the_way']:.0%} of the way to the "
                     f"limit")
    lines.append("  legend: step = median ratio of paired training steps; block = one block in "
                 "the timeline (its recorder costs each op a little, and a block run alone in "
                 "two halves pays their fill and drain, once per block instead of once per "
                 "step); limit and ceiling are the block's, estimates for a step")
    return lines
