"""`profile --link 1gbit,2gbit,4gbit,8gbit`: tp and tp_overlap at each link rate and over
loopback, drawn against the two limits that say when overlap pays.

Each rate is one ordinary `--link` run (link.py) of the modes tp and tp_overlap,
interleaved step by step like every profile run, so each rate's ratio comes with its paired
95 % interval; the loopback point is one ordinary local run of the same flags (with the
timeline, for the compute limit). Each writes its own results folder under OUT/sweep/, and the
sweep reads them back.

The limits, per step and per rank (no run can be faster than either):

- comm-bound = bytes one rank sends per step / link rate. The bytes are derived from the
  model's shapes: every all-gather and reduce-scatter of a step moves a full activation
  [s, b, h] of which each rank sends (p - 1) / p; a step of L blocks has 10 L + 5 of them
  (forward: embedding RS; per block qkv AG, proj RS, fc1 AG, fc2 RS; head AG. Backward: head
  AG + RS; per block fc2 AG, fc1 AG + RS, proj AG, qkv AG + RS; embedding AG). The ring
  versions move the same bytes in p - 1 steps. Left out: the all-reduces of the norm
  gradients, the loss and the grad norm (a few KiB). The derived count is checked against the
  bytes each rank's interface really sent during each mode's steps (read around every step
  from /sys/class/net, headers included): tp_overlap's ring
  sends what the count says (+ 4.6 % of TCP/IP/Ethernet headers at MTU 1500); tp's gloo
  collectives send more (measured ~17.6 against ~13.1 MiB per step at the profile's defaults),
  so the comm-bound of tp is drawn from its measured bytes as well.
- compute-bound = tp's step time over loopback x (1 - blocked / total) of the loopback
  timeline's block (medians over its recordings, slowest rank of each): the step without the
  time the ranks sat blocked in communication. On this
  CPU a transfer's own CPU work stays in it (it is not hideable here, see profiling/README.md).
"""
import json
import os
import subprocess
import sys

from ..measure.metrics import MiB
from ..report import plots
from ..report.output import write_text
from . import link

MODES = ("tp", "tp_overlap")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def bytes_per_step(config, batch, seq, tp, dtype):
    """Bytes one rank sends in one training step, from the shapes (see the module docstring)."""
    s = seq + (-seq) % tp  # the hand-written modes pad the sequence to a multiple of p
    activation = s * batch * config.hidden_size * DTYPE_BYTES[dtype]
    transfers = 10 * config.num_layers + 5
    return transfers * activation * (tp - 1) // tp


def _step_stats(results, mode):
    st = results["modes"][mode]["step_time"]
    return {"median_s": st["median"], "p10_s": st["p10"], "p90_s": st["p90"]}


def _read(folder):
    with open(os.path.join(folder, "results.json")) as f:
        return json.load(f)


def run(argv, args, threads):
    """The whole sweep; returns the process exit status. `argv`: the profile's flags."""
    base = link.argv_for_ranks(argv, threads) + ["--bench-iters", "0"]
    out = os.path.join(args.out, "sweep")
    points = []
    for bps, text in args.link_rates:
        with link.EmulatedLink(args.tp, bps, text) as net:
            print(f"--- sweep: {report_rate(net.describe())}", flush=True)
            point = {"rate": text, "rate_bits_per_s": bps,
                     "measured_bits_per_s": net.describe()["measured_bits_per_s"]}
            folder = os.path.join(out, text)
            net.run_ranks([sys.executable, "-m", "tensor_parallel_toy", "profile", *base,
                           "--modes", ",".join(MODES), "--timeline-iters", "0",
                           "--out", folder])
            results = _read(folder)
            for mode in MODES:
                point[mode] = {**_step_stats(results, mode), "veth_tx_bytes_per_step":
                               results["modes"][mode]["sent_bytes_per_step"]}
            point["ratio"] = results["ratios"]["tp_overlap/tp"]
        points.append(point)
    print("--- sweep: loopback", flush=True)
    folder = os.path.join(out, "loopback")
    subprocess.run([sys.executable, "-m", "tensor_parallel_toy", "profile", *base,
                    "--modes", ",".join(MODES), "--timeline-iters",
                    str(max(1, args.timeline_iters)), "--out", folder], check=True)
    sweep = summarize(points, _read(folder), args)
    write_text(os.path.join(args.out, "sweep.json"), json.dumps(sweep, indent=1))
    plots.plot_sweep(sweep, os.path.join(args.out, "sweep.png"))
    print(text_table(sweep), end="")
    print(f"wrote sweep.json, sweep.png to {args.out}/ (each run's files in {out}/)")
    return 0


def summarize(points, loopback, args):
    tl = loopback["timeline"]["summary"]["tp"]["over_recordings"]
    blocked, total = tl["blocked_in_comm_ms"]["median"], tl["total_ms"]["median"]
    tp_loopback = loopback["modes"]["tp"]["step_time"]["median"]
    derived = bytes_per_step(args.config, args.batch, args.seq, args.tp, args.dtype)
    return {"rates": points,
            "loopback": {mode: _step_stats(loopback, mode) for mode in MODES},
            "loopback_ratio": loopback["ratios"]["tp_overlap/tp"],
            "bytes_per_step_derived": derived,
            "compute_bound_s": tp_loopback * (1 - blocked / total),
            "definitions": {
                "comm_bound_s": "bytes_per_step_derived * 8 / rate",
                "compute_bound_s": "loopback tp median step x (1 - blocked / total) of the "
                                   "loopback timeline's block (tp), medians over its "
                                   "recordings",
                "veth_tx_bytes_per_step": "median over the timed steps of the bytes the "
                                          "busier rank's interface sent during the step "
                                          "(TCP/IP and Ethernet headers included, ~4.6 % at "
                                          "MTU 1500)",
                "ratio": "tp_overlap / tp, median of paired interleaved steps, bootstrap "
                         "95 % interval"},
            "meta": {"tp": args.tp, "steps": args.steps, "batch": args.batch, "seq": args.seq,
                     "dtype": args.dtype, "cpu_count": os.cpu_count(),
                     "command": " ".join(["python -m tensor_parallel_toy profile", *args.argv])}}


def report_rate(described):
    measured = described["measured_bits_per_s"]
    return f"link {described['rate']}, one TCP stream measured {measured / 1e9:.2f} Gbit/s"


def text_table(sweep):
    lines = [f"\nsweep: step time, ms (median [p10-p90]); bytes one rank sends per step: "
             f"{sweep['bytes_per_step_derived'] / MiB:.2f} MiB derived",
             f"{'link':<10}{'measured':>10}{'veth MiB/step tp, ovl':>23}{'comm-bound':>12}"
             f"{'tp':>22}{'tp_overlap':>22}{'ratio [95% interval]':>24}"]

    def cell(st):
        return f"{st['median_s'] * 1e3:.1f} [{st['p10_s'] * 1e3:.1f}-{st['p90_s'] * 1e3:.1f}]"

    for p in sweep["rates"]:
        bound = sweep["bytes_per_step_derived"] * 8 / p["rate_bits_per_s"]
        lines.append(f"{p['rate']:<10}{p['measured_bits_per_s'] / 1e9:>8.2f}Gb"
                     f"{p['tp']['veth_tx_bytes_per_step'] / MiB:>17.2f}, "
                     f"{p['tp_overlap']['veth_tx_bytes_per_step'] / MiB:.2f}"
                     f"{bound * 1e3:>12.1f}"
                     f"{cell(p['tp']):>22}{cell(p['tp_overlap']):>22}"
                     f"{p['ratio']['ratio']:>9.2f} [{p['ratio']['ci95'][0]:.2f}-"
                     f"{p['ratio']['ci95'][1]:.2f}]")
    lo, r = sweep["loopback"], sweep["loopback_ratio"]
    lines.append(f"{'loopback':<10}{'':>10}{'':>23}{'':>12}{cell(lo['tp']):>22}"
                 f"{cell(lo['tp_overlap']):>22}"
                 f"{r['ratio']:>9.2f} [{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}]")
    lines.append(f"compute-bound: {sweep['compute_bound_s'] * 1e3:.1f} ms "
                 f"({sweep['definitions']['compute_bound_s']})")
    return "\n".join(lines) + "\n"
