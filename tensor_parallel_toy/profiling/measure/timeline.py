"""Record when each rank computes and communicates during one block's forward + backward.

Spans, per rank, in two rows:
- compute: every non-view aten op, timed by a TorchDispatchMode (GEMMs, attention, the rest),
  plus the time the compute side spent posting a transfer and blocked waiting for one;
- comm: each transfer from the moment it is posted until the moment its wait returned.

The ring's code is the same on both devices (post, compute, wait: see ring.py); what a span
means follows the device:
- CPU: host timestamps (`time.perf_counter`, one clock for every process on the machine). gloo's
  P2P work handles can only be waited on once and have no completion callback, so a transfer's
  end is when its wait returned: if the wait did not block, the transfer finished earlier,
  under the compute before it. "post" is the host's time spent posting; "wait" the host
  blocked in a wait.
- CUDA: every stamp is a CUDA event on this rank's current (compute) stream, so a span is what
  the GPU did, not when the host queued it. "wait" is the time the compute stream stalled at a
  `wait()`, from an event queued just before it to one just after: NCCL's stream had not
  finished the transfer yet. A transfer's bar runs from its post (NCCL's stream may start
  then) to the end of its wait. Posting costs the host, not the stream: no "post" spans.

`record_into(clock)` watches torch.distributed's entry points from outside the library
(transfers.py's `recording`) with a `_Recorder`, so whatever runs inside it has every
collective and ring step seen (a whole model's: the vocabulary-parallel embedding and loss and the norms' `f`
included; the profile records one block), and the code being timed is the package's
own, unmodified.
"""
import contextlib
import functools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ...guards.collectives import barrier, reduce_numbers
from ...halves import block_in_halves
from ...launcher.initialize import current_device
from ...model import TransformerBlock, draw_full_weights_, rotary_tables
from .metrics import stamp
from .metrics import summarize as distribution
from .transfers import recording

GEMM_OPS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "linear"}
SPAN_NAMES = {"ring": "send/recv"}  # a transfer's span is named by its kind, a ring step's so


class Clock:
    """Host timestamps on CPU, CUDA events on the current stream of `device` on GPU; `add()`
    stores spans of either kind, and `finish()` turns them into milliseconds since the clock
    was made."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        self.spans = []
        self.origin = self.stamp()

    def stamp(self):
        return stamp(self.device)

    def add(self, row, kind, name, start, end, **extra):
        self.spans.append({"row": row, "kind": kind, "name": name, "start": start, "end": end,
                           **extra})

    def add_transfer(self, kind, start, end, nbytes):
        self.add("comm", kind, SPAN_NAMES.get(kind, kind), start, end, bytes=nbytes)

    def finish(self):
        """Convert every stamp to milliseconds since the origin."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            ms = lambda e: self.origin.elapsed_time(e)  # noqa: E731
        else:
            ms = lambda t: (t - self.origin) * 1e3  # noqa: E731
        for span in self.spans:
            span["start"], span["end"] = ms(span["start"]), ms(span["end"])
        return self.spans


class _OpTimer(TorchDispatchMode):
    """Times every aten op that does work (views are free and skipped)."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "aten" or func.is_view:
            return func(*args, **(kwargs or {}))  # transfers are timed by the _Recorder
        start = self.clock.stamp()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        kind = ("gemm" if name in GEMM_OPS else
                "attention" if "attention" in name else "other")
        self.clock.add("compute", kind, name, start, self.clock.stamp())
        return out


class _TimedHandle:
    """Wraps a posted transfer's handle: its `wait()` is recorded, and ends the transfer's bar."""

    def __init__(self, handle, clock, kind, start, nbytes):
        self.handle, self.clock, self.kind = handle, clock, kind
        self.start, self.nbytes = start, nbytes

    def wait(self):
        begin = self.clock.stamp()
        self.handle.wait()  # CPU: the host blocks; CUDA: the compute stream waits, not the host
        end = self.clock.stamp()
        self.clock.add("compute", "wait", "wait", begin, end)
        self.clock.add_transfer(self.kind, self.start, end, self.nbytes)


class _Recorder:
    """What `transfers.recording` calls for each transfer."""

    def __init__(self, clock):
        self.clock = clock

    def transfer(self, kind, nbytes, post):
        clock = self.clock
        start = clock.stamp()
        handle = post()
        if handle is None:  # a blocking call: nothing computed until it was done
            end = clock.stamp()
            clock.add("compute", "wait", "wait", start, end)
            clock.add_transfer(kind, start, end, nbytes)
            return None
        if not clock.cuda:
            clock.add("compute", "post", "post", start, clock.stamp())
        return _TimedHandle(handle, clock, kind, start, nbytes)


@contextlib.contextmanager
def record_into(clock):
    """Record every transfer of the package and time every op, into `clock`."""
    with recording(_Recorder(clock)), _OpTimer(clock):
        yield clock


def _record_once(block, x_in, dy, cos, sin, device, group):
    barrier(group)  # every rank starts at (nearly) the same time
    clock = Clock(device)
    with record_into(clock):
        y = block(x_in, cos, sin)
        forward_end = clock.stamp()
        y.backward(dy)
    end = clock.stamp()
    clock.add("marker", "forward_end", "forward end", forward_end, forward_end)
    clock.add("marker", "end", "end", end, end)
    return clock.finish()


def record(spec):
    """On every rank: one TransformerBlock's forward + backward, without and with overlap (the
    rings; and the two halves, `block_in_halves`, when tp_halves is among the modes),
    recorded `spec.timeline_iters` times each (interleaved, so a burst of load from outside
    hits both alike). Keeps, per mode, the spans of the recording whose slowest-rank time is
    the median, and the numbers (`span_totals`) of every recording.
    Returns {mode: {"spans": this rank's spans in ms, "recordings": [span_totals, ...]}}."""
    group, device = dist.group.WORLD, current_device()
    p, config = dist.get_world_size(group), spec.config
    dtype = spec.torch_dtype
    s, b, h = spec.seq, spec.batch, config.hidden_size
    # [s, 1, 1, hd/2], as Transformer.rotary shapes them for its blocks
    cos, sin = (t.to(device)[:, None, None]
                for t in rotary_tables(s, config.head_dim, config.rope_base))
    gen = torch.Generator().manual_seed(spec.seed)
    x = torch.randn(s // p, b, h, generator=gen).to(device, dtype)  # [s/p, b, h]
    dy = torch.randn(s // p, b, h, generator=gen).to(device, dtype)
    modes = ("tp", "tp_overlap") + (("tp_halves",) if "tp_halves" in spec.modes else ())
    blocks, inputs, run = {}, {}, {}
    for mode in modes:
        blocks[mode] = TransformerBlock(config, group, overlap=mode == "tp_overlap",
                                        ring_pieces=spec.ring_pieces)
        run[mode] = (functools.partial(block_in_halves, blocks[mode], group=group)
                     if mode == "tp_halves" else blocks[mode])
        draw_full_weights_(blocks[mode], group, spec.seed)  # as the Transformer draws its own
        blocks[mode].to(device, dtype)
        inputs[mode] = x.clone().requires_grad_()
        for warm in range(2):  # warm-up, the first one recorded and thrown away: the first
            with record_into(Clock(device)) if warm == 0 else contextlib.nullcontext():
                run[mode](inputs[mode], cos, sin).backward(dy)  # pass through the timers
    runs = {mode: [] for mode in modes}
    for _ in range(spec.timeline_iters):
        for mode in modes:
            runs[mode].append(_record_once(run[mode], inputs[mode], dy, cos, sin, device,
                                           group))
    out = {}
    for mode in modes:
        if device.type == "cuda":  # one more pass, under torch.profiler: NCCL's kernels
            out.setdefault(mode, {})["nccl_kernel_ms"] = _nccl_kernel_ms(
                lambda m=mode: run[m](inputs[m], cos, sin).backward(dy), device)
        totals = reduce_numbers([max(s["end"] for s in spans) for spans in runs[mode]], group,
                                dist.ReduceOp.MAX)  # the slowest rank's: the same on all ranks
        median = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
        out.setdefault(mode, {}).update({
            "spans": runs[mode][median],
            "recordings": [span_totals(spans) for spans in runs[mode]]})
    return out


def nccl_kernel_us(kernels):
    """Microseconds spent in NCCL's kernels, from (name, microseconds) pairs of GPU kernels;
    NCCL names every kernel it launches `ncclKernel_...` or `ncclDevKernel_...`."""
    return sum(us for name, us in kernels if name.startswith(("ncclKernel", "ncclDevKernel")))


def _nccl_kernel_ms(step, device):
    """How long NCCL's kernels ran during one `step()` on this rank's GPU: a CUDA-only number
    (on CPU gloo runs no kernels), read from torch.profiler's record of the GPU's kernels.
    The kernels run on NCCL's stream, beside the compute stream's: they are the transfers' own
    time, which the timeline's waits (the compute stream's stalls) cannot show."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return nccl_kernel_us(kernels) / 1e3


def span_totals(spans):
    """One rank's recording in a few numbers (ms): the block's time, and how long the compute
    side was blocked waiting for communication (CPU: the host; CUDA: the compute stream),
    posting transfers (CPU only: 0 on CUDA, where posting costs the host, not the stream), and
    in GEMMs, and the transfers' bars added up."""
    def length(keep):
        return sum(s["end"] - s["start"] for s in spans if keep(s))
    return {"total_ms": max(s["end"] for s in spans if s["kind"] == "end"),
            "blocked_in_comm_ms": length(lambda s: s["kind"] == "wait"),
            "gemm_ms": length(lambda s: s["kind"] == "gemm"),
            "posting_ms": length(lambda s: s["kind"] == "post"),
            "comm_span_ms": length(lambda s: s["row"] == "comm")}


DISTRIBUTED = ("total_ms", "blocked_in_comm_ms", "posting_ms")  # over recordings, in summarize


def summarize(per_rank):
    """Per mode: the drawn recording's block time (slowest rank) and its numbers per rank, and
    over all recordings (`over_recordings`), each of DISTRIBUTED as {median, p10, p90, min,
    max, n, values}, where a recording's value is its slowest rank's."""
    result = {}
    for mode in per_rank[0]:
        ranks = [span_totals(r[mode]["spans"]) for r in per_rank]
        recordings = list(zip(*(r[mode]["recordings"] for r in per_rank)))  # [rec][rank]
        over = {}
        for key in DISTRIBUTED:
            values = [max(rank[key] for rank in rec) for rec in recordings]
            over[key] = {**distribution(values), "values": values}
        result[mode] = {"total_ms": max(r["total_ms"] for r in ranks), "per_rank": ranks,
                        "over_recordings": over}
        if "nccl_kernel_ms" in per_rank[0][mode]:  # CUDA: the slowest rank's NCCL kernel time
            result[mode]["nccl_kernel_ms"] = max(r[mode]["nccl_kernel_ms"] for r in per_rank)
    return result
