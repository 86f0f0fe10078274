"""A stand-in for a strict process group: every call into torch.distributed's communication is
checked on its way through, inside the worker ranks.

Two rules, the ones NCCL enforces the hard way (a group initialised with "nccl" has no CPU
backend: a CPU tensor fails with "No backend type associated with device type cpu"):
- every tensor a collective or P2P call touches lives on the group's device,
  `collectives.group_device(group)`;
- the package reaches torch.distributed only through comm.py and guards/collectives.py, the
  places that put tensors on that device, so no module can quietly make a CPU tensor for a GPU
  group (the profile's `transfers.recording`, which wraps the same entry points, is looked
  through to its caller).
On CPU (gloo) the first rule can only pass; the second is what fails there when a module talks
to torch.distributed on its own, as the profile's timing code once did. Under NCCL (the GPU
check) both rules are live. Violations are collected, not raised, so that every rank still
joins every collective and the test can list them all.
"""
import contextlib
import sys

import torch
import torch.distributed as dist

from tensor_parallel_toy import comm
from tensor_parallel_toy.guards import collectives
from tensor_parallel_toy.profiling.measure import transfers

# The communication entry points of torch.distributed that a module might call. Not isend and
# irecv: P2POp accepts only the originals as its op (comm.send_recv passes them to P2POp, and
# batch_isend_irecv, checked here, runs them).
_ENTRY_POINTS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                 "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                 "broadcast", "barrier", "all_gather_object", "broadcast_object_list",
                 "batch_isend_irecv", "send", "recv", "all_to_all_single", "gather", "scatter",
                 "reduce")
_DOORS = {comm.__name__, collectives.__name__}  # the modules of the package allowed to call them
_LOOKED_THROUGH = transfers.__name__


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dist.P2POp):
        yield value.tensor
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _group_of(args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    for value in args:
        if isinstance(value, dist.ProcessGroup):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], dist.P2POp):
            return value[0].group
    return None


def _guarded(name, fn, violations):
    def call(*args, **kwargs):
        frame = probe = sys._getframe(1)
        for _ in range(8):  # inside a recording: the caller is whoever called its wrapper
            if probe is None:
                break
            if probe.f_globals.get("__name__") == _LOOKED_THROUGH and \
                    probe.f_code.co_name == "call":
                frame = probe.f_back
                break
            probe = probe.f_back
        caller = frame.f_globals.get("__name__", "?")
        where = f"{caller}:{frame.f_lineno}"
        if caller.startswith("tensor_parallel_toy") and caller not in _DOORS:
            violations.add(f"{where} called torch.distributed.{name} directly, not through "
                           f"comm.py or guards/collectives.py")
        device = collectives.group_device(_group_of(args, kwargs))
        for t in _tensors([*args, *kwargs.values()]):
            if t.device != device:
                violations.add(f"{where}: torch.distributed.{name} got a tensor on "
                               f"{t.device}, the group's device is {device}")
        return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def guard_collectives():
    """Inside: every communication call is checked (see the module docstring); yields the set
    of violations found, as lines."""
    violations = set()
    originals = {name: getattr(dist, name) for name in _ENTRY_POINTS if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, _guarded(name, fn, violations))
    try:
        yield violations
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def guarded_call(fn, *args):
    """Run `fn(*args)` on a rank with the guard on: (its result, sorted violations)."""
    with guard_collectives() as violations:
        result = fn(*args)
    return result, sorted(violations)


class GuardedRunner:
    """A phases runner (see profiling/run/phases.py) over a local pool whose every phase runs with
    the guard on in every rank; `violations` collects what the ranks found."""

    def __init__(self, pool_runner):
        self.inner, self.rank = pool_runner, 0
        self.violations = []

    def run(self, fn, *args):
        per_rank = self.inner.run(guarded_call, fn, *args)
        for rank, (_, found) in enumerate(per_rank):
            self.violations += [f"rank {rank}: {line}" for line in found
                                if f"rank {rank}: {line}" not in self.violations]
        return [result for result, _ in per_rank]
