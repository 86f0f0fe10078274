"""`profile --link model:0.25gbit,0.5gbit,...`: the column layer's all-gather + GEMM on the
modeled wire (wire.py) across rates and ring pieces, against the ring's schedule bound.

One op, one shape (the profile's s, b, h and an MLP width f), so the GEMM stays the same while
the rate moves the transfer from far below the GEMM to far above it: the compute-bound side,
where a good schedule hides all of the transfer, and the communication-bound side, where it
can at best hide the GEMM. For every rate and every number of pieces m (PIECES) the op is timed
as the benchmark times it (bench_overlap.Op: the transfers alone, the GEMMs alone, the
package's overlapped op, interleaved round by round, the slowest rank of each round), and set
against three lines a learner can read off:

- nothing hidden: comm + GEMM;
- the physical limit: max(comm, GEMM), which no schedule beats;
- the schedule bound of ring.py with p ranks and m pieces (bench_overlap.schedule_time): with
  one piece at p = 2 the transfer hides only under the local chunk's GEMM, max(comm, GEMM/2) +
  GEMM/2; with m, about max(GEMM, comm + GEMM/(2m)).

The wire is a model (it costs the cores nothing, the host sleeps while bytes are "on the
wire"), so this shows what the schedule can hide, not what this machine's software wire
allows (the veth sweep, link_sweep.py, measures that).
"""
import json
import os

import torch
import torch.distributed as dist

from ...guards.collectives import reduce_numbers
from ...launcher.initialize import current_device
from ...launcher.pool import WorkerPool
from ..measure.bench_overlap import Op, median, schedule_time, timed
from ..measure.metrics import keep_freed_memory
from ..report import plots
from ..report.output import write_text
from ..spec import DTYPES
from . import wire

PIECES = (1, 2, 4, 8)
ROUNDS = 15


def _point(description, pieces, shape, dtype_name, rounds):
    """On every rank, on the modeled wire: the column forward's variants timed `rounds` times,
    interleaved; the slowest rank's seconds of each round."""
    keep_freed_memory()
    group, device = dist.group.WORLD, current_device()
    s, b, h, f = shape
    torch.manual_seed(1234)
    with wire.modeled(description):
        op = Op("column_fwd", s, b, h, f, group, device, DTYPES[dtype_name], pieces=pieces)
        (comm, gemm, _), = op.phases
        variants = {"comm": comm, "gemm": gemm, "overlap": op.overlap}
        for fn in variants.values():  # warm-up
            fn()
        times = {v: [] for v in variants}
        for _ in range(rounds):  # interleaved, as the benchmark times its variants
            for name, fn in variants.items():
                times[name].append(timed(fn, device, group)[0])
    return {v: reduce_numbers(t, group, dist.ReduceOp.MAX) for v, t in times.items()}


def measure(pool, spec, rates, shape, rounds=ROUNDS, pieces=PIECES, say=print):
    """Every (rate, m) point: medians of the slowest rank, the bound and the limits (ms)."""
    p = spec.tp
    points = []
    for description in rates:
        for m in pieces:
            t = pool.run(_point, description, m, shape, spec.dtype, rounds)[0]
            med = {v: median(ts) for v, ts in t.items()}
            bound = schedule_time(med["comm"], med["gemm"], p, m)
            point = {"rate": description["rate"], "bits_per_s": description["bits_per_s"],
                     "pieces": m, **{f"t_{v}_ms": x * 1e3 for v, x in med.items()},
                     "bound_ms": bound * 1e3,
                     "max_ms": max(med["comm"], med["gemm"]) * 1e3,
                     "sum_ms": (med["comm"] + med["gemm"]) * 1e3,
                     "comm_over_gemm": med["comm"] / med["gemm"],
                     "overlap_over_bound": med["overlap"] / bound,
                     "overlap_over_max": med["overlap"] / max(med["comm"], med["gemm"])}
            say(f"  {description['rate']:>8} m={m}: comm {point['t_comm_ms']:.2f} gemm "
                f"{point['t_gemm_ms']:.2f} overlapped {point['t_overlap_ms']:.2f} ms, bound "
                f"{point['bound_ms']:.2f}, overlapped / bound {point['overlap_over_bound']:.2f}")
            points.append(point)
    return points


def run(args):
    """The whole sweep on a local pool; writes wire_sweep.json and wire_sweep.png."""
    spec = args.spec
    shape = spec.bench_shape or (spec.seq, spec.batch, spec.config.hidden_size,
                                 2 * spec.config.ffn_hidden_size)
    s, b, h, f = shape
    print(f"wire sweep: column forward AG+GEMM, s={s} b={b} h={h} f={f} p={spec.tp} "
          f"{spec.dtype}, on a MODELED wire (not a network), rates "
          f"{', '.join(d['rate'] for d in args.wire_rates)}, ring pieces {PIECES}", flush=True)
    with WorkerPool(spec.tp, backend="gloo") as pool:
        points = measure(pool, spec, args.wire_rates, shape)
    sweep = {"points": points, "shape": {"s": s, "b": b, "h": h, "f": f, "p": spec.tp,
                                         "dtype": spec.dtype},
             "wire": {k: v for k, v in args.wire_rates[0].items() if k != "rate"},
             "definitions": {
                 "bound_ms": "ring.py's schedule with p ranks and m pieces, played with the "
                             "comm and GEMM medians alone (bench_overlap.schedule_time)",
                 "max_ms": "max(comm, GEMM): no schedule beats it",
                 "sum_ms": "comm + GEMM: nothing hidden"},
             "meta": {"cpu_count": os.cpu_count(), "threads_per_rank": torch.get_num_threads(),
                      "command": " ".join(["python -m tensor_parallel_toy profile",
                                           *args.argv])}}
    os.makedirs(args.out, exist_ok=True)
    write_text(os.path.join(args.out, "wire_sweep.json"), json.dumps(sweep, indent=1))
    plots.plot_wire_sweep(sweep, os.path.join(args.out, "wire_sweep.png"))
    print(f"wrote wire_sweep.json, wire_sweep.png to {args.out}/")
    return 0
