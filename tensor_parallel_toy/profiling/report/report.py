"""From the ranks' raw numbers to results.json's sections and the printed summary.

The targets and their verdicts are targets.py's (their bounds and texts are data, targets.json);
the summary prints the verdicts results.json holds.
"""
from ..measure.metrics import MiB, ratio_interval, summarize
from .landing import landing_lines
from .targets import fmt_ratio, fmt_spread

RATIOS = (("tp_overlap", "tp"), ("tp_halves", "tp"), ("tp_halves", "tp_overlap"),
          ("tp_overlap", "dtensor"), ("tp", "dtensor"), ("tp_halves", "dtensor"),
          ("tp_overlap", "hf_dtensor"), ("tp", "hf_dtensor"),
          ("tp", "baseline"), ("tp_overlap", "baseline"), ("tp_halves", "baseline"))


def combine_mode(per_rank, warmup, tokens_per_step):
    """One mode's per-rank results -> loss, grad norm, slowest-rank step times, stats, memory."""
    ranks = [r for r in per_rank if r is not None]
    steps = len(ranks[0]["step_time_s"])
    slowest = [max(r["step_time_s"][i] for r in ranks) for i in range(steps)]
    stats = summarize(slowest[warmup:])
    sent = {}
    if all("sent_bytes" in r for r in ranks):  # over a real interface: bytes on the wire
        per_step = [max(r["sent_bytes"][i] for r in ranks) for i in range(steps)]
        sent = {"sent_bytes_per_step": summarize(per_step[warmup:])["median"]}
    return {"loss": ranks[0]["loss"], "grad_norm": ranks[0]["grad_norm"],
            "step_time_s": slowest, "step_time_s_per_rank": [r["step_time_s"] for r in ranks],
            "step_time": stats, "tokens_per_s": tokens_per_step / stats["median"],
            "memory_per_rank": [r["memory"] for r in ranks],
            "threads_per_rank": [r["threads"] for r in ranks],
            "loss_spread_across_ranks": max(abs(a - b) for r in ranks
                                            for a, b in zip(r["loss"], ranks[0]["loss"])),
            **sent}


def add_baseline_errors(modes):
    base = modes.get("baseline")
    if base is None:
        return
    for mode, data in modes.items():
        if mode == "baseline":
            continue
        data["loss_rel_err_vs_baseline"] = [abs(a - b) / abs(b)
                                            for a, b in zip(data["loss"], base["loss"])]
        data["grad_norm_rel_err_vs_baseline"] = [abs(a - b) / abs(b) for a, b in
                                                 zip(data["grad_norm"], base["grad_norm"])]


def step_time_ratios(modes, warmup):
    """{"a/b": median ratio of step times and its paired-bootstrap 95 % interval} for the mode
    pairs of RATIOS present in this run (the slowest rank's time of each step after warm-up)."""
    return {f"{a}/{b}": ratio_interval(modes[a]["step_time_s"][warmup:],
                                       modes[b]["step_time_s"][warmup:])
            for a, b in RATIOS if a in modes and b in modes}


def link_text(link):
    """One line on the emulated link (wires/link.py) or the modeled wire (wires/wire.py) the
    ranks talked over."""
    if link.get("kind") == "model":
        return (f"link: MODEL of a {link['rate']} wire, {link['latency_s'] * 1e6:.0f} us per "
                f"hop: {link['what']}")
    measured = link.get("measured_bits_per_s")
    speed = (f"; {link['measured_by']}: {measured / 1e9:.2f} Gbit/s ({measured / 8e6:.0f} MB/s)"
             if measured else "")
    return (f"link: {link['rate']} ({link['qdisc']}), {link['topology']} between network "
            f"namespaces {', '.join(link['namespaces'])} ({link['interface']}, "
            f"{link['addresses'][0]}-{link['addresses'][-1]}){speed}")


def link_label(meta):
    """A short tag for plot titles: which network the ranks used."""
    link = meta.get("link")
    if not link:
        return ("loopback, one machine" if meta.get("launcher") == "WorkerPool"
                else f"{meta.get('backend')}, {meta.get('launcher')}")
    if link.get("kind") == "model":
        return f"modeled {link['rate']} wire (a model, not a network)"
    measured = link.get("measured_bits_per_s")
    return f"link {link['rate']}" + (f", {measured / 1e9:.2f} Gbit/s measured" if measured else "")


def _threads(n):
    return f"{n} thread" + ("" if n == 1 else "s")


def _hidden(share):
    """A share of min(comm, GEMM) hidden, its sign spelled out when overlap cost time."""
    return f"{share:.0%}" + (" (cost time)" if share < 0 else "")


def _fmt_ms(seconds):
    return f"{seconds * 1e3:.1f}"


def _blocks_lines(bench):
    """The overlap benchmark's ratios over blocks of rounds, one line per op."""
    first = next(iter(bench["ops"].values()))["overlap_over_max_blocks"]
    k = first["rounds_per_block"]
    lines = [f"op time / max(comm alone, gemm alone) per block of {k} rounds, {first['n']} "
             f"blocks, median [p10-p90]:",
             f"{'op':<36}{'overlapped':>20}{'basic':>20}{'nothing hidden':>16}"]
    for row in bench["ops"].values():
        nothing = (row["t_comm_ms"] + row["t_gemm_ms"]) / max(row["t_comm_ms"], row["t_gemm_ms"])
        lines.append(f"{row['label']:<36}{fmt_spread(row['overlap_over_max_blocks']):>20}"
                     f"{fmt_spread(row['basic_over_max_blocks']):>20}{nothing:>16.2f}")
    lines.append(f"  legend: 1.00 = the limit, all of the shorter part hidden; nothing hidden = "
                 f"(comm + gemm) / max(comm, gemm); a block can come out below 1.00 because its "
                 f"own comm and gemm alone are medians of {k} noisy rounds too")
    return lines


def _timeline_lines(tl, gpu=False):
    """The timeline over all its recordings if results.json has them, else the drawn one."""
    summary = tl["summary"]
    if not all("over_recordings" in s for s in summary.values()):
        parts = [f"{mode} {s['total_ms']:.1f} ms (blocked in comm "
                 f"{max(r['blocked_in_comm_ms'] for r in s['per_rank']):.1f} ms)"
                 for mode, s in summary.items()]
        return ["timeline, one block forward + backward (median of "
                f"{tl['iterations']} recordings): " + ", ".join(parts)]
    lines = [f"timeline, one block forward + backward, {tl['iterations']} recordings per mode, "
             f"slowest rank of each, ms, median [p10-p90] (the median recording is drawn):"]
    for mode, s in summary.items():
        over = s["over_recordings"]
        blocked = "compute stream stalled at waits" if gpu else "blocked in comm"
        posting = "" if gpu else f", posting {fmt_spread(over['posting_ms'], 1)}"
        nccl = (f", NCCL kernels {s['nccl_kernel_ms']:.1f} (one more pass)"
                if "nccl_kernel_ms" in s else "")
        lines.append(f"  {mode:<11} total {fmt_spread(over['total_ms'], 1)}, {blocked} "
                     f"{fmt_spread(over['blocked_in_comm_ms'], 1)}{posting}, min-max total "
                     f"{over['total_ms']['min']:.1f}-{over['total_ms']['max']:.1f}{nccl}")
    lines.append("  legend: total = the block's forward + backward; " + (
        "compute stream stalled at waits = time the compute stream waited for communication"
        if gpu else "blocked in comm = time the host sat waiting for a transfer; posting = "
        "time the host spent starting transfers"))
    return lines


def _tp_no_sp_line(classic, modes):
    mem = max(classic["memory_per_rank"], key=lambda m: m["saved_activation_bytes"])
    state = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
    activations = {m: max(r["saved_activation_bytes"] for r in modes[m]["memory_per_rank"])
                   for m in ("baseline", "tp") if m in modes}
    others = ", ".join(f"{m} {b / MiB:.1f}" for m, b in activations.items())
    return (f"tp_no_sp (classic TP without sequence parallelism, TP={classic['tp']}, one step, "
            f"not trained): saved activations {mem['saved_activation_bytes'] / MiB:.1f} MiB/rank"
            + (f" ({others})" if others else "") + f", state {state / MiB:.1f} MiB; step-0 loss "
            f"{classic['loss']:.4f}, {classic['loss_rel_diff_vs_baseline']:.1e} relative to the "
            f"baseline's {classic['baseline_loss']:.4f}")


def summary_text(results):
    meta, run = results["meta"], results["config"]["run"]
    model = results["config"]["model"]
    busy = meta["world_size"] * meta["threads_per_rank"]
    crowded = meta["device"] == "cpu" and busy > (meta["cpu_count"] or busy)
    grid = (f"DP={meta['dp']} (FSDP2) x TP={meta['tp']}" if meta.get("dp", 1) > 1
            else f"TP={meta['tp']}")
    lines = [
        f"tensor_parallel_toy profile: {grid} over {meta['backend']} on "
        f"{meta['device']}, torch {meta['torch']}, {meta['cpu_count']} CPU cores, "
        f"{_threads(meta['threads_per_rank'])} per TP rank, baseline (one process, no "
        f"parallelism) on {_threads(meta['baseline_threads'])}",
        f"model: {'Llama (SwiGLU MLP), ' if run.get('model') == 'llama' else ''}"
        f"hidden {model['hidden_size']}, {model['num_layers']} layers, "
        f"{model['num_heads']} heads, ffn {model['ffn_hidden_size']}, vocab {model['vocab_size']}"
        f"; batch {run['batch']} x seq {run['seq']} = {run['batch'] * run['seq']} tokens/step, "
        f"{run['steps']} steps ({run['warmup']} warm-up), AdamW lr {run['lr']:g}, {run['dtype']}",
    ]
    if meta["device"] == "cuda":
        lines.append(f"GPU: {meta.get('gpu')}; NCCL's streams at "
                     f"{'high' if meta.get('nccl_high_priority_streams') else 'normal'} priority;"
                     f" times are CUDA events on each rank's compute stream")
    if meta.get("overlap_weight_grad") and run["dtype"] != "fp32":
        lines.append(f"overlapped layers' weight gradient: {meta['overlap_weight_grad']}")
    if meta.get("link"):
        lines.append(link_text(meta["link"]))
    if meta.get("link") and "baseline" in results["modes"]:
        lines.append("the baseline mode ran on rank 0 alone, as always: it has no communication, "
                     "so the link does not change it")
    if crowded:
        lines.append(f"NOTE: {meta['world_size']} ranks x {meta['threads_per_rank']} thread(s) on "
                     f"{meta['cpu_count']} cores: the ranks take turns on the cores, so the "
                     f"timings say little about overlap")
    load = {k: v for k, v in (meta.get("external_load_cores") or {}).items() if v is not None}
    if load:
        lines.append("CPU used by other work on this machine (cores, /proc/stat minus our "
                     "processes): " + ", ".join(f"{k} {v:.2f}" for k, v in load.items()))
    lines += ["", f"{'mode':<11}{'loss 0 -> last':>17}{'max rel dloss':>15}{'grad norm':>11}"
                  f"{'max rel dnorm':>15}{'step ms median [p10-p90]':>27}{'tokens/s':>10}"
                  f"{'MiB/rank: act + param+grad+opt':>33}"]
    for mode, d in results["modes"].items():
        st = d["step_time"]
        mem = max(d["memory_per_rank"], key=lambda m: m["saved_activation_bytes"])
        state = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
        dloss = d.get("loss_rel_err_vs_baseline")
        dnorm = d.get("grad_norm_rel_err_vs_baseline")
        losses = f"{d['loss'][0]:.4f} -> {d['loss'][-1]:.4f}"
        step = f"{_fmt_ms(st['median'])} [{_fmt_ms(st['p10'])}-{_fmt_ms(st['p90'])}]"
        memory = f"{mem['saved_activation_bytes'] / MiB:.1f} + {state / MiB:.1f}"
        lines.append(f"{mode:<11}{losses:>17}{(f'{max(dloss):.1e}' if dloss else '-'):>15}"
                     f"{d['grad_norm'][-1]:>11.4f}{(f'{max(dnorm):.1e}' if dnorm else '-'):>15}"
                     f"{step:>27}{d['tokens_per_s']:>10.0f}{memory:>33}")
    lines.append("  legend: loss at step 0 and at the last step, grad norm at the last step; max "
                 "rel dloss, dnorm = the largest |mode - baseline| / baseline over the steps; "
                 "step ms = one training step of the slowest rank, after warm-up; MiB/rank = "
                 "activations saved for backward + weights, gradients and AdamW state, on the "
                 "largest rank")
    if results.get("memory_tp_no_sp"):
        lines += ["", _tp_no_sp_line(results["memory_tp_no_sp"], results["modes"])]
    if results.get("ratios"):
        lines += ["", "step-time ratios a/b (below 1: a is faster), median of paired interleaved "
                      "steps [bootstrap 95% interval]: " + ", ".join(f"{k} {fmt_ratio(r)}"
                                                for k, r in results["ratios"].items())]
    bench = results.get("overlap_benchmark")
    if bench:
        sh = bench["shape"]
        lines += ["", f"per-op overlap benchmark, each op of one MLP timed alone (ms, median "
                      f"over rounds of the slowest rank): s={sh['s']} "
                      f"b={sh['b']} h={sh['h']} m={sh['f']} p={sh['p']} {sh['dtype']}"
                      + (f", ring pieces {sh['pieces']}" if "pieces" in sh else "")
                      + (" (MLP size m calibrated so comm ~ 0.4 x GEMM)"
                         if sh["calibrated"] else "")]
        # Results written before the schedule bound was reported render as they did then.
        bounded = all("schedule_bound_ms" in row for row in bench["ops"].values())
        lines.append(f"{'op':<36}{'comm':>7}{'gemm':>7}{'seq':>7}{'overlap':>8}{'basic':>7}"
                     + (f"{'bound':>7}{'hidden vs seq':>15}{'hidden vs parts':>17}"
                        if bounded else f"{'hidden vs seq':>19}{'hidden vs parts':>19}")
                     + f"{'overlap/max':>13}" + (f"{'overlap/bound':>15}" if bounded else "")
                     + f"{'ceiling: schedule':>19}{'cpu':>6}")
        for row in bench["ops"].values():
            cpu = f"{row['cpu_ceiling']:.0%}" if "cpu_ceiling" in row else "-"
            hidden = (f"{row['schedule_bound_ms']:>7.2f}{_hidden(row['hidden']):>15}"
                      f"{_hidden(row['hidden_vs_parts']):>17}" if bounded else
                      f"{_hidden(row['hidden']):>19}{_hidden(row['hidden_vs_parts']):>19}")
            lines.append(f"{row['label']:<36}{row['t_comm_ms']:>7.2f}{row['t_gemm_ms']:>7.2f}"
                         f"{row['t_seq_ms']:>7.2f}{row['t_overlap_ms']:>8.2f}"
                         f"{row['t_basic_ms']:>7.2f}{hidden}{row['overlap_over_max']:>13.2f}"
                         + (f"{row['overlap_over_bound']:>15.2f}" if bounded else "")
                         + f"{row['schedule_ceiling']:>19.0%}{cpu:>6}")
        lines.append("  legend: comm, gemm = the transfers alone, the GEMMs alone; seq = the two "
                     "one after the other; overlap, basic = the package's layer with overlap="
                     "True (rings), False (whole collectives); hidden = time saved against seq "
                     "(or comm + gemm) as a share of min(comm, gemm): 100% = all of the shorter "
                     "part hidden, negative = overlap cost time; overlap/max = overlap / "
                     "max(comm, gemm), 1.00 at the limit; "
                     + ("bound = the best time of the ring's schedule for these p and pieces "
                        "on a wire that costs no compute (bench_overlap.schedule_time), "
                        "overlap/bound 1.00 at it; " if bounded else "")
                     + "ceiling = the most a perfect p-chunk ring (schedule) or a transfer's "
                       "own CPU time (cpu) leaves hideable")
        if all("overlap_over_max_blocks" in row for row in bench["ops"].values()):
            lines += [""] + _blocks_lines(bench)
    tl = results.get("timeline")
    if tl:
        lines += [""] + _timeline_lines(tl, meta["device"] == "cuda")
    if results.get("landing"):
        lines += [""] + landing_lines(results["landing"])
    lines += ["", "targets (met: the measured value, or its whole 95% interval, is on the right "
                  "side of the bound; MISSED: it is not, short by how much; n/a: this run cannot "
                  "decide):"]
    for t in results["targets"]:
        status = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        line = f"  [{status}] {t['name']}: {t['measured']:.3g}"
        if t.get("interval"):
            line += f" [95% {t['interval'][0]:.3g}-{t['interval'][1]:.3g}]"
        if t["short_by"] is not None:
            line += f", short by {t['short_by']:.3g}"
        lines.append(line)
        if t["reason"]:
            lines.append(f"           why: {t['reason']}")
        if t.get("note") and t["note"] != t["reason"]:
            lines.append(f"           note: {t['note']}")
    return "\n".join(lines) + "\n"
