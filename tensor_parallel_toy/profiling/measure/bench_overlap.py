"""Per-op overlap benchmark: how much communication does each overlapped op really hide?

The four overlapped ops of an MLP's two layers (fc1 = column h -> f, fc2 = row f -> h), per rank:

    column_fwd  AG+GEMM   X_r [s/p, b, h] -> gather X [s, b, h];  Y_r = X W_r^T   [s, b, f/p]
    row_fwd     GEMM+RS   partial Y = X_r W_r^T [s, b, h];  reduce-scatter -> [s/p, b, h]
    row_bwd     AG+GEMM   gather dY [s, b, h];  dX_r = dY W_r, dW_r = dY^T X_r
    column_bwd  AG+GEMM,  gather X for dW_r = dY_r^T X;  dX = dY_r W_r [s, b, h] reduce-
                GEMM+RS   scattered to [s/p, b, h]

Each op is one or two *phases*, a ring transfer paired with the GEMMs that can run under it.
For every op we time, with the same ring transfers and the same GEMMs:

    T_comm     the ring transfers alone            T_gemm     the GEMMs alone
    T_seq      transfers, then GEMMs (no overlap)  T_overlap  the package's op, overlap=True
    T_basic    the package's op, overlap=False (whole collectives), for reference

T_overlap and T_basic time the public ops (`column_parallel_linear`, `row_parallel_linear`)
as training runs them: a forward through autograd, or a backward through `torch.autograd.grad`
on a graph built once, so the code timed is the package's own.

    hidden = (T_seq - T_overlap) / min(T_comm, T_gemm)   1.0: all the hideable time is hidden
    T_overlap / max(T_comm, T_gemm)                      1.0: the physical limit of overlap

The five variants run once per round, interleaved, so rounds close in time are paired
samples: besides the ratio of the medians, `overlap_over_max_blocks` and
`basic_over_max_blocks` give the spread of T_overlap / max(T_comm, T_gemm) and
T_basic / max(T_comm, T_gemm) over blocks of ROUNDS_PER_BLOCK consecutive rounds, each block's
ratio from the medians of its own rounds (the slowest rank of each variant in each round).

T_seq can come out longer than T_comm + T_gemm: the first rank done with its exchange starts
its GEMM while its peer is still exchanging, and on CPU the peer's transfer then slows down (a
barrier between exchange and GEMM removes the effect; presumably the GEMM holds the core that
gloo's thread needs to finish the transfer). We report how long the transfers took inside the
sequential run, and `hidden_vs_parts`, the same formula with T_comm + T_gemm for T_seq; the
target is checked on the smaller of the two, so a slow sequential run cannot pass for hiding.

Two ceilings explain a shortfall. The *schedule* ceiling: with p ranks the ring has p GEMM
chunks and p-1 transfers, and a transfer can only hide under the chunk being computed, so the
best possible time is  sum_k max(T_gemm/p, T_comm/(p-1)) + T_gemm/p. The *CPU* ceiling (gloo):
a transfer is not free for the host, gloo's threads copy the bytes through the kernel; with
every core already running a rank's GEMM, that CPU time C_comm can only be taken from the GEMM,
so at best  hidden <= 1 - C_comm / T_comm.
"""
import time

import torch
import torch.distributed as dist

from ...guards.collectives import barrier, reduce_numbers
from ...launcher.initialize import current_device
from ...parallel_linear import column_parallel_linear, row_parallel_linear
from ...ring import Ring, ring_all_gather, ring_reduce_scatter
from .metrics import DeviceTimer
from .metrics import summarize as distribution

OPS = {
    "column_fwd": "AG+GEMM, column forward",
    "row_fwd": "GEMM+RS, row forward",
    "row_bwd": "AG+GEMM, row backward",
    "column_bwd": "AG+GEMM & GEMM+RS, column backward",
}
VARIANTS = ("comm", "gemm", "seq", "overlap", "basic")
TARGET_COMM_OVER_GEMM = 0.4  # calibration: comm is 40% of the GEMM (why: see choose_ffn)
ROUNDS_PER_BLOCK = 5  # rounds per ratio in the spread of op time / max(comm, GEMM)


def _forward(op, x, w, group, pieces):
    """The op's forward, both schedules: {False: basic, True: overlapped (the ring, in `pieces`
    pieces per chunk)}, each a zero-argument callable."""
    return {o: (lambda o=o: op(x, w, None, group, overlap=o, ring_pieces=pieces))
            for o in (False, True)}


def _backward(op, x, w, dy, group, pieces):
    """The op's backward, both schedules, each on a graph built once here (a collective: every
    rank builds its ops in the same order) and replayed: the grads of x and w from dy."""
    graphs = {o: op(x, w, None, group, overlap=o, ring_pieces=pieces) for o in (False, True)}
    return {o: (lambda y=y: torch.autograd.grad(y, (x, w), dy, retain_graph=True))
            for o, y in graphs.items()}


def _ring_gather_into(full, ring, n):
    """ring.py's all-gather into the slices of `full` ([s, ...], this rank's n rows filled):
    the transfers the overlapped Function makes, with nothing computed under them but the copy
    of each arriving block into its place."""
    r, rows = ring.rank, ring.block_rows(n)

    def place(i, block):
        if i // ring.pieces != r:
            full[i * rows:(i + 1) * rows].copy_(block)
    ring_all_gather(full[r * n:(r + 1) * n], place, ring)


class Op:
    """The tensors of one op on this rank and its five variants as zero-argument callables."""

    def __init__(self, name, s, b, h, f, group, device, dtype, pieces=1):
        p = dist.get_world_size(group)
        r = dist.get_rank(group)
        n = s // p
        ring = Ring(group, pieces)
        q = ring.block_rows(n)  # rows of one ring block (a piece of a chunk)
        self.device, self.seq_comm_s = device, []
        new = lambda *shape, grad=False: torch.randn(  # noqa: E731
            *shape, device=device, dtype=dtype).requires_grad_(grad)
        mm = lambda a, b_, out: torch.mm(a.reshape(-1, a.shape[-1]), b_,  # noqa: E731
                                         out=out.view(-1, out.shape[-1]))
        if name == "column_fwd":
            x_r, w = new(n, b, h, grad=True), new(f // p, h, grad=True)
            x_full, y = new(s, b, h), new(s, b, f // p)
            x_full[r * n:(r + 1) * n] = x_r.detach()
            self.phases = [(lambda: _ring_gather_into(x_full, ring, n),
                            lambda: mm(x_full, w.detach().t(), y), "comm first")]
            schedules = _forward(column_parallel_linear, x_r, w, group, pieces)
        elif name == "row_fwd":
            x, w = new(s, b, f // p, grad=True), new(h, f // p, grad=True)
            part = new(s, b, h)
            self.phases = [(lambda: ring_reduce_scatter(lambda i: part[i * q:(i + 1) * q], ring),
                            lambda: mm(x.detach(), w.detach().t(), part), "gemm first")]
            schedules = _forward(row_parallel_linear, x, w, group, pieces)
        elif name == "row_bwd":
            x, w, dy_r = new(s, b, f // p, grad=True), new(h, f // p, grad=True), new(n, b, h)
            dy_full, dx, dw = new(s, b, h), new(s, b, f // p), new(h, f // p)
            dy_full[r * n:(r + 1) * n] = dy_r
            self.phases = [(lambda: _ring_gather_into(dy_full, ring, n),
                            lambda: (mm(dy_full, w.detach(), dx),
                                     mm(dy_full.flatten(0, 1).t(), x.detach().flatten(0, 1), dw)),
                            "comm first")]
            schedules = _backward(row_parallel_linear, x, w, dy_r, group, pieces)
        elif name == "column_bwd":
            x_r, w, dy = new(n, b, h, grad=True), new(f // p, h, grad=True), new(s, b, f // p)
            x_full, dw, dx_full = new(s, b, h), new(f // p, h), new(s, b, h)
            x_full[r * n:(r + 1) * n] = x_r.detach()
            self.phases = [
                (lambda: _ring_gather_into(x_full, ring, n),
                 lambda: mm(dy.flatten(0, 1).t(), x_full.flatten(0, 1), dw), "comm first"),
                (lambda: ring_reduce_scatter(lambda i: dx_full[i * q:(i + 1) * q], ring),
                 lambda: mm(dy, w.detach(), dx_full), "gemm first")]
            schedules = _backward(column_parallel_linear, x_r, w, dy, group, pieces)
        else:
            raise ValueError(f"unknown op {name!r}; valid: {', '.join(OPS)}")
        self.basic, self.overlap = schedules[False], schedules[True]

    def comm(self):
        for comm, _, _ in self.phases:
            comm()

    def gemm(self):
        for _, gemm, _ in self.phases:
            gemm()

    def seq(self):
        """No overlap: a gather phase must receive before it computes, a reduce-scatter
        phase must compute the partial sums before it sends them. Records how long the
        transfers took in here (`self.seq_comm_s`), to compare with the transfers alone."""
        timers = []
        for comm, gemm, order in self.phases:
            if order == "gemm first":
                gemm()
            with DeviceTimer(self.device) as timer:
                comm()
            timers.append(timer)
            if order == "comm first":
                gemm()
        self.seq_comm_s.append(sum(t.seconds for t in timers))  # CUDA: read after queueing


def timed(fn, device, group):
    """(time, CPU of the whole process, CPU of this thread) seconds of one call of `fn`. The
    time is the host's on CPU, the GPU's (CUDA events on this rank's stream) on CUDA. Process
    minus thread CPU is what gloo's own threads spent (meaningful on CPU only)."""
    barrier(group)  # every rank starts the op together
    c0, m0 = time.process_time(), time.thread_time()
    with DeviceTimer(device) as timer:
        fn()
    return timer.seconds, time.process_time() - c0, time.thread_time() - m0


def _median_max(fn, device, group, iters):
    """Median over `iters` runs of the slowest rank's time."""
    times = reduce_numbers([timed(fn, device, group)[0] for _ in range(iters)], group,
                           dist.ReduceOp.MAX)
    return median(times)


def choose_ffn(s, b, h, group, device, dtype, ratio=TARGET_COMM_OVER_GEMM):
    """The f that makes the column forward's GEMM take T_comm / ratio on this machine.

    Why 0.4 and not 1.0: with p ranks a transfer can only hide under one chunk's GEMM, 1/p of
    it, so at p=2 a transfer longer than half the GEMM cannot be hidden by this schedule.
    0.4 keeps comm and GEMM of the same order while leaving room for the schedule to work.
    """
    p = dist.get_world_size(group)
    f = 4 * h
    for _ in range(2):  # GEMM time is close to linear in f: two refinements are enough
        op = Op("column_fwd", s, b, h, f, group, device, dtype)
        for _ in range(3):
            op.comm(), op.gemm()
        t_comm = _median_max(op.comm, device, group, 9)
        t_gemm = _median_max(op.gemm, device, group, 9)
        f = int(round(f * (t_comm / ratio) / t_gemm / (8 * p))) * 8 * p
        f = min(max(f, 8 * p), 64 * h)
    return f


def run(spec):
    """On every rank: calibrate (unless spec.bench_shape is given) and time every op.
    Returns this rank's raw per-iteration times (the slowest rank's are taken later)."""
    group = dist.group.WORLD
    device = current_device()
    dtype = spec.torch_dtype
    torch.manual_seed(1234)
    if spec.bench_shape:
        s, b, h, f = spec.bench_shape
        calibrated = False
    else:
        s, b, h = spec.seq, spec.batch, spec.config.hidden_size
        f = choose_ffn(s, b, h, group, device, dtype)
        calibrated = True
    raw = {}
    for name in OPS:
        op = Op(name, s, b, h, f, group, device, dtype, spec.ring_pieces)
        fns = {v: getattr(op, v) for v in VARIANTS}
        for _ in range(spec.bench_warmup):
            for fn in fns.values():
                fn()
        times = {v: [] for v in VARIANTS}
        cpu, cpu_main = [], []
        for _ in range(spec.bench_iters):
            for variant, fn in fns.items():  # interleaved: slow drifts in load hit all alike
                wall, proc, main = timed(fn, device, group)
                times[variant].append(wall)
                if variant == "comm":
                    cpu.append(proc)
                    cpu_main.append(main)
        phases = []
        for comm, gemm, order in op.phases:  # per-phase alone times, for the schedule ceiling
            phases.append({"comm": [timed(comm, device, group)[0] for _ in range(9)],
                           "gemm": [timed(gemm, device, group)[0] for _ in range(9)],
                           "order": order})
        raw[name] = {"times": times, "comm_cpu": cpu, "comm_cpu_main": cpu_main,
                     "seq_comm": op.seq_comm_s[-len(times["seq"]):], "phases": phases}
    p = dist.get_world_size(group)
    return {"shape": {"s": s, "b": b, "h": h, "f": f, "p": p, "calibrated": calibrated,
                      "dtype": spec.dtype, "pieces": spec.ring_pieces},
            "raw": raw, "device": device.type}


def median(values):
    return float(torch.tensor(values, dtype=torch.float64).median())


def schedule_time(t_comm, t_gemm, p, m=1, order="comm first"):
    """The best time of ring.py's schedule for one phase: p chunks of m pieces each, a piece's
    GEMM taking t_gemm / (p m), its transfer t_comm / ((p - 1) m) on a wire that carries one
    transfer at a time and costs the core nothing. Played step by step as the code runs:
    "comm first" (ring_all_gather): wait for the piece, pass it on, compute on it; "gemm first"
    (ring_reduce_scatter): compute the piece's partial, wait for the running sum, pass it on.
    At p = 2 it is max(t_comm, t_gemm/2) + t_gemm/2 with one piece and about
    max(t_gemm, t_comm + t_gemm/(2m)) with m."""
    g, c = t_gemm / (p * m), t_comm / ((p - 1) * m)
    t = wire_free = 0.0
    arrival = {}
    for k in range(p):
        for j in range(m):
            if order == "gemm first":
                t += g
            if k > 0:
                t = max(t, arrival[k, j])
            if k < p - 1:
                wire_free = max(t, wire_free) + c
                arrival[k + 1, j] = wire_free
            if order == "comm first":
                t += g
    return t


def _over_max_blocks(slowest, variant, k=ROUNDS_PER_BLOCK):
    """T_variant / max(T_comm, T_gemm) per block of k consecutive rounds (the last one may be
    shorter), each from the medians of that block's own times: {median, p10, ..., n (blocks),
    rounds_per_block, values}.

    Why blocks and not single rounds: on a CPU one call's time jitters by 20-30 %, the alone
    times' as much as the op's, so a one-round ratio can fall below 1.0, which no op can beat;
    the median of k rounds damps that jitter, while load that drifts over seconds still hits
    the op and its reference alike."""
    ratios = []
    for start in range(0, len(slowest["comm"]), k):
        med = {v: median(slowest[v][start:start + k]) for v in (variant, "comm", "gemm")}
        ratios.append(med[variant] / max(med["comm"], med["gemm"]))
    return {**distribution(ratios), "rounds_per_block": k, "values": ratios}


def summarize(per_rank):
    """Combine the ranks' raw times (slowest rank per iteration) into the reported numbers."""
    first = per_rank[0]
    p, m = first["shape"]["p"], first["shape"].get("pieces", 1)
    out = {"shape": first["shape"], "ops": {}}
    for name, label in OPS.items():
        slowest = {v: [max(r["raw"][name]["times"][v][i] for r in per_rank)
                       for i in range(len(first["raw"][name]["times"][v]))] for v in VARIANTS}
        t = {v: median(slowest[v]) for v in VARIANTS}
        c_comm = max(median(r["raw"][name]["comm_cpu"]) for r in per_rank)
        c_main = max(median(r["raw"][name]["comm_cpu_main"]) for r in per_rank)
        # The schedule ceiling from the per-phase times alone (numerator and denominator from
        # the same measurements, so it lies in [0, 1]).
        phases = [(max(median(ph["comm"]) for ph in ranks),
                   max(median(ph["gemm"]) for ph in ranks),
                   ranks[0].get("order", "comm first"))
                  for ranks in zip(*(r["raw"][name]["phases"] for r in per_rank))]
        bound = sum(schedule_time(c, g, p, m, order) for c, g, order in phases)
        saved = sum(c + g for c, g, _ in phases) - bound
        ceiling = saved / min(sum(c for c, _, _ in phases), sum(g for _, g, _ in phases))
        hideable = min(t["comm"], t["gemm"])
        seq_comm = median([max(r["raw"][name]["seq_comm"][i] for r in per_rank)
                            for i in range(len(first["raw"][name]["seq_comm"]))])
        hidden_vs_parts = (t["comm"] + t["gemm"] - t["overlap"]) / hideable
        hidden = (t["seq"] - t["overlap"]) / hideable
        row = {"label": label, **{f"t_{v}_ms": t[v] * 1e3 for v in VARIANTS},
               "t_comm_inside_seq_ms": seq_comm * 1e3,
               "hidden": hidden,
               "hidden_vs_parts": hidden_vs_parts,
               # A sequential run slower than its parts (its transfers wait for a peer that
               # is already computing) must not count as hiding: the target uses this one.
               "hidden_conservative": min(hidden, hidden_vs_parts),
               "overlap_over_max": t["overlap"] / max(t["comm"], t["gemm"]),
               "overlap_over_max_blocks": _over_max_blocks(slowest, "overlap"),
               "basic_over_max_blocks": _over_max_blocks(slowest, "basic"),
               "comm_over_gemm": t["comm"] / t["gemm"],
               "schedule_ceiling": ceiling,
               # The schedule's own best time for these phases (p chunks, m pieces), and the
               # op against it: 1.0 is all the schedule allows.
               "schedule_bound_ms": bound * 1e3,
               "overlap_over_bound": t["overlap"] / bound}
        if first["device"] == "cpu":
            row["comm_cpu_ms"] = c_comm * 1e3
            row["comm_cpu_posting_thread_ms"] = c_main * 1e3
            row["cpu_ceiling"] = max(0.0, 1 - c_comm / t["comm"])
        out["ops"][name] = row
    return out
