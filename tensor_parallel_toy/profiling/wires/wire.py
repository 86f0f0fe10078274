"""`profile --link model:RATE`: a model of a wire that costs the compute cores nothing.

On the emulated link (link.py) the bytes cross a real software wire, gloo, TCP, a veth pair
and tbf, whose CPU work lands on the same cores as both ranks' GEMMs: there a GEMM beside a
transfer runs slower, and what the overlap schedule itself can hide is hidden by that. On a GPU
a transfer runs on NCCL's stream, a copy engine or a NIC, beside the GEMM. This module models
such a wire inside each rank, from outside the library (it wraps torch.distributed's entry
points, as measure/transfers.py does):

- every transfer's bytes really move, so the results are the package's own, but through
  shared memory between the ranks (shared_wire.py: one copy in at the post, one copy out at
  the wait, at memory speed), not through gloo's socket, whose copies would run on the posting
  thread; the transfer completes only at its modeled arrival time, and the host *sleeps* until
  then rather than computing the wire;
- the arrival time: the rank's outgoing wire carries one transfer at a time, so a transfer
  posted at t starts at max(t, the end of the previous one), takes bytes / rate on the wire,
  and arrives `latency` per hop after that;
- the bytes a rank sends are what a ring moves: an all-gather (p-1) times its shard, a
  reduce-scatter (p-1)/p of its input, an all-reduce twice that, a broadcast the tensor, a
  ring step (P2P) its send buffer; a collective pays p-1 hops of latency, a ring step one.
  Every mode's communication crosses the same wire, so the modes compare on one wire.
- each rank models its own sends: in the package's rings and collectives every rank sends as
  much as it receives, at the same step, so its transfer arrives when its peer's does.

Bookkeeping (barriers, objects) is not modeled. PyTorch's DTensor runs its collectives through
its functional collectives, which this wrapper does not see: a modeled run leaves the DTensor
modes out. Every output of such a run says that the link is a model, not a measurement.
"""
import contextlib
import functools
import inspect
import time

import torch.distributed as dist

from ...comm import ALL_GATHER, REDUCE_SCATTER
from ..measure.transfers import nbytes, sent_by_ring_step, wrapped
from . import shared_wire
from .link import UNITS

PREFIX = "model:"
LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3}
DEFAULT_LATENCY_S = 20e-6  # per hop: a NIC and a switch, roughly
FORMS = "model:RATE or model:RATE:LATENCY, e.g. model:1gbit, model:4gbit:50us"


def is_model(text):
    return text is not None and text.startswith(PREFIX)


def parse(text):
    """'model:1gbit[:20us]' -> the wire's description (a dict for results.json); ValueError,
    one line, otherwise."""
    parts = text[len(PREFIX):].split(":")
    try:
        number, unit = _split_unit(parts[0], UNITS)
        latency = DEFAULT_LATENCY_S
        if len(parts) > 1:
            value, latency_unit = _split_unit(parts[1], LATENCY_UNITS)
            latency = value * LATENCY_UNITS[latency_unit]
        if len(parts) > 2 or number <= 0 or latency < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"--link {text!r}: expected {FORMS}") from None
    return {"kind": "model", "rate": parts[0], "bits_per_s": number * UNITS[unit],
            "latency_s": latency,
            "what": "a model of a wire that uses no compute core: each transfer arrives at "
                    "latency + bytes / rate, one at a time per direction, the host asleep "
                    "meanwhile (not a measurement of a network)"}


def parse_rates(text):
    """'model:1gbit' or 'model:0.5gbit,1gbit,2gbit[:LATENCY on each]' -> [description, ...]."""
    return [parse(PREFIX + part) for part in text[len(PREFIX):].split(",")]


def _split_unit(text, units):
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[:-len(unit)]), unit
    raise ValueError(text)


class ModeledWire:
    """One rank's outgoing wire: when it is free, and when a transfer posted now arrives."""

    def __init__(self, bits_per_s, latency_s):
        self.bytes_per_s, self.latency_s = bits_per_s / 8, latency_s
        self.free_at = 0.0

    def arrival(self, sent, hops):
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + sent / self.bytes_per_s
        return self.free_at + hops * self.latency_s

    def delivery_s(self, sent, hops=1):
        """The model's time for one transfer alone on the wire (for tests and reports)."""
        return sent / self.bytes_per_s + hops * self.latency_s


class _Arriving:
    """A posted transfer's handle whose wait() also waits for the modeled arrival."""

    def __init__(self, transfer, arrival):
        self.transfer, self.at = transfer, arrival

    def wait(self):
        self.transfer.wire.move_all()  # copy out what is already here while the wire runs
        _sleep_until(self.at)
        return self.transfer.wait()


def _sleep_until(at):
    left = at - time.perf_counter()
    if left > 0:
        time.sleep(left)


@functools.lru_cache(maxsize=None)
def _signature(fn):
    return inspect.signature(fn)  # read once per entry point: 0.1 ms a call otherwise


def _call(name, fn, args, kwargs, shared):
    """One call of torch.distributed's `name`, carried over the shared wire: (bytes this rank
    puts on the modeled wire at ring cost, hops, async_op, post() -> the posted transfer)."""
    a = _signature(fn).bind(*args, **kwargs)
    a.apply_defaults()
    a = a.arguments
    group = a["group"]
    p = dist.get_world_size(group)
    if name == ALL_GATHER:
        out, shard = a["output_tensor"], a["input_tensor"]
        if out.numel() != p * shard.numel() or not out.is_contiguous():
            raise ValueError(f"{name}: output of {out.numel()} elements for {p} "
                             f"shards of {shard.numel()}")
        return ((p - 1) * nbytes(shard), p - 1, a["async_op"],
                lambda: shared.all_gather_parts(out.chunk(p), shard, group))
    if name == "all_gather":
        return ((p - 1) * nbytes(a["tensor"]), p - 1, a["async_op"],
                lambda: shared.all_gather_parts(a["tensor_list"], a["tensor"], group))
    if name == REDUCE_SCATTER:
        return ((p - 1) * nbytes(a["input"]) // p, p - 1, a["async_op"],
                lambda: shared.reduce_scatter(a["output"], a["input"], a["op"], group))
    if name == "all_reduce":
        return (2 * (p - 1) * nbytes(a["tensor"]) // p, 2 * (p - 1), a["async_op"],
                lambda: shared.all_reduce(a["tensor"], a["op"], group))
    src = a["src"] if a["group_src"] is None else dist.get_global_rank(group, a["group_src"])
    return (nbytes(a["tensor"]), 1, a["async_op"],
            lambda: shared.broadcast(a["tensor"], src, group))


def _wired_collective(name, fn, wire, shared):
    def call(*args, **kwargs):
        sent, hops, async_op, post = _call(name, fn, args, kwargs, shared)
        handle = _Arriving(None, wire.arrival(sent, hops))  # on the wire from now
        handle.transfer = post()
        if not async_op:  # a blocking call: the host waits for the wire here
            handle.wait()
            return None
        return handle
    return call


def _wired_ring_step(wire, shared):
    def call(ops):
        arrival = wire.arrival(sent_by_ring_step(ops), 1)
        return [_Arriving(shared.ring_step(ops), arrival)]
    return call


@contextlib.contextmanager
def modeled(description, capacity=shared_wire.CAPACITY):
    """Inside, every transfer of this rank crosses the modeled wire `description` (`parse`),
    its bytes through shared memory (shared_wire.py). Collective: every rank enters it."""
    wire = ModeledWire(description["bits_per_s"], description["latency_s"])
    with shared_wire.shared_wire(capacity) as shared:

        def wrap(name, fn):
            if name == "batch_isend_irecv":
                return _wired_ring_step(wire, shared)
            return _wired_collective(name, fn, wire, shared)

        with wrapped(wrap):
            yield wire


def run_on_wire(description, fn, *args):
    """`fn(*args)` with this rank's transfers on the modeled wire (a phase, in a worker)."""
    with modeled(description):
        return fn(*args)


class WiredRunner:
    """A phases runner whose every phase runs on the modeled wire in every rank."""

    def __init__(self, inner, description):
        self.inner, self.rank, self.description = inner, inner.rank, description

    def run(self, fn, *args):
        return self.inner.run(run_on_wire, self.description, fn, *args)
