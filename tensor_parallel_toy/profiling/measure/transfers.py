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
"""
import contextlib

import torch.distributed as dist

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
