"""Watch every transfer a piece of code makes, from outside the library.

`recording(recorder)` wraps torch.distributed's entry points that the package's collectives and
ring call (comm.py, guards/collectives.py) for as long as it is active, and hands each call to
`recorder.transfer(kind, nbytes, post)`:
- `kind`: "all-gather", "reduce-scatter", "all-reduce", "broadcast", or "ring" (one P2P step
  of ring.py: a send and a receive posted together);
- `nbytes`: the bytes this rank puts in (an all-gather's shard, a reduce-scatter's whole
  input, a ring step's send buffer);
- `post()`: makes the call and returns its handle (anything with `wait()`), or None when the
  call blocked until it was done.
The recorder returns what `post()` gave, or a handle with the same `wait()` (the timeline's
times the wait). The library is not changed or told: the code measured is the code that runs.
Only one recording at a time.

`DispatchedCollectives` watches one level lower, at PyTorch's dispatcher: every collective op
(`c10d.*`, which torch.distributed's entry points call, and `_c10d_functional.*`, which
DTensor's redistributions and the functional collectives call without passing those entry
points) is counted with the bytes this rank puts in, by the same rules. It sees code the
wrappers above miss (`transformers`' TP moves most of its bytes through DTensor), only counts,
and slows what runs under it (every op passes through Python): count an untimed step.
"""
import collections
import contextlib

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ...comm import ALL_GATHER, REDUCE_SCATTER, Pending

# entry point -> (kind, where the tensor whose bytes count is among the positional arguments)
COLLECTIVES = {ALL_GATHER: ("all-gather", 1),
               REDUCE_SCATTER: ("reduce-scatter", 1), "all_gather": ("all-gather", 1),
               "all_reduce": ("all-reduce", 0), "broadcast": ("broadcast", 0)}


def nbytes(t):
    return t.numel() * t.element_size()


def sent_by_ring_step(ops):
    """The bytes a batch_isend_irecv call sends: its isends' tensors."""
    return sum(nbytes(op.tensor) for op in ops if op.op is dist.isend)


@contextlib.contextmanager
def wrapped(wrap):
    """Inside, torch.distributed's entry points the package's transfers use (COLLECTIVES and
    batch_isend_irecv) are `wrap(name, original)`; the originals are back afterwards, also
    after an error."""
    originals = {name: getattr(dist, name) for name in (*COLLECTIVES, "batch_isend_irecv")}
    try:
        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _watched_collective(fn, kind, where, recorder):
    def call(*args, **kwargs):
        return recorder.transfer(kind, nbytes(args[where]), lambda: fn(*args, **kwargs))
    call.recording = True
    return call


def _watched_ring_step(fn, recorder):
    def call(ops):
        handle = recorder.transfer("ring", sent_by_ring_step(ops), lambda: Pending(fn(ops)))
        return [handle]
    call.recording = True
    return call


@contextlib.contextmanager
def recording(recorder):
    """Report every transfer made inside the block to `recorder` (see the module docstring)."""
    if getattr(dist.all_reduce, "recording", False):
        raise RuntimeError("a recording of the transfers is already active")

    def wrap(name, fn):
        if name == "batch_isend_irecv":
            return _watched_ring_step(fn, recorder)
        return _watched_collective(fn, *COLLECTIVES[name], recorder)

    with wrapped(wrap):
        yield recorder


# dispatcher op (namespace.name) -> (kind, the positional argument whose bytes count: a tensor or
# a list of them). Waits, barriers and the received side of a P2P transfer move nothing counted.
DISPATCHED = {
    "c10d.allreduce_": ("all-reduce", 0), "c10d.allreduce_coalesced_": ("all-reduce", 0),
    "c10d._allgather_base_": ("all-gather", 1), "c10d.allgather_": ("all-gather", 1),
    "c10d.allgather_into_tensor_coalesced_": ("all-gather", 1),
    "c10d._reduce_scatter_base_": ("reduce-scatter", 1), "c10d.reduce_scatter_": ("reduce-scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1),
    "c10d.broadcast_": ("broadcast", 0), "c10d.alltoall_base_": ("all-to-all", 1),
    "c10d.send": ("send", 0),
    "_c10d_functional.all_reduce": ("all-reduce", 0),
    "_c10d_functional.all_reduce_coalesced": ("all-reduce", 0),
    "_c10d_functional.all_gather_into_tensor": ("all-gather", 0),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all-gather", 0),
    "_c10d_functional.reduce_scatter_tensor": ("reduce-scatter", 0),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce-scatter", 0),
    "_c10d_functional.all_to_all_single": ("all-to-all", 0),
    "_c10d_functional.broadcast": ("broadcast", 0),
}
NOT_TRANSFERS = ("wait_tensor", "barrier", "recv_", "recv_any_source_", "_wrap_tensor_autograd",
                 "monitored_barrier_")


# kind -> the bytes a rank sends when a ring carries the collective, per byte it puts in, at p
# ranks (as wires/wire.py charges them): an all-gather sends its shard to p - 1 ranks, a
# reduce-scatter (p - 1)/p of its input, an all-reduce both.
RING_FACTOR = {"all-gather": lambda p: p - 1, "reduce-scatter": lambda p: (p - 1) / p,
               "all-reduce": lambda p: 2 * (p - 1) / p, "all-to-all": lambda p: (p - 1) / p,
               "broadcast": lambda p: 1, "send": lambda p: 1, "ring": lambda p: 1}


def ring_sent_bytes(bytes_by_kind, p):
    """The bytes a rank sends over a ring for {kind: bytes it put in} at p ranks."""
    return sum(RING_FACTOR[kind](p) * n for kind, n in bytes_by_kind.items())


def _bytes_of(arg):
    if torch.is_tensor(arg):
        return nbytes(arg)
    return sum(_bytes_of(a) for a in arg) if isinstance(arg, (list, tuple)) else 0


class DispatchedCollectives(TorchDispatchMode):
    """`with DispatchedCollectives() as seen:` every collective op dispatched inside, by kind:
    `seen.calls[kind]`, `seen.bytes[kind]` (this rank's input, as `recording` counts it);
    `seen.unknown`: the names of collective ops not in DISPATCHED, so a new one is reported
    instead of silently left out."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes = collections.Counter(), collections.Counter()
        self.unknown = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A DTensor's op first runs DTensor's own dispatch (NotImplemented hands it over), which
        # redistributes with functional collectives on plain tensors: those come back here.
        if any(issubclass(t, torch.distributed.tensor.DTensor) for t in types):
            return NotImplemented
        op = str(func).rsplit(".", 1)[0]  # "c10d.allreduce_.default" -> "c10d.allreduce_"
        namespace, _, name = op.partition(".")
        if namespace in ("c10d", "_c10d_functional"):
            entry = DISPATCHED.get(op)
            if entry is not None:
                kind, where = entry
                self.calls[kind] += 1
                self.bytes[kind] += _bytes_of(args[where])
            elif name not in NOT_TRANSFERS:
                self.unknown.add(op)
        return func(*args, **(kwargs or {}))
