"""Small collectives for bookkeeping: numbers, objects, barriers, a broadcast.

The guards use them to compare what the ranks built and hold (agreement.py), the harness to
reduce its timings and gather its results, the launcher to wait for every rank. None of them is
part of the layers' arithmetic; each tensor they make lives on `group_device(group)`, the one
device NCCL accepts.
"""
import torch
import torch.distributed as dist

from ..comm import all_reduce_, group_size


def group_device(group=None):
    """Where a tensor must live to travel over `group` (None: the default group): this rank's
    GPU under NCCL (the one `torch.cuda.set_device` chose), else the CPU. A group initialised
    with "nccl" has no CPU backend: a CPU tensor fails there ("No backend type associated with
    device type cpu")."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_(x, source, group):
    """Overwrite `x` with group rank `source`'s `x`, in place, on every rank; returns `x`."""
    if group_size(group) > 1:
        dist.broadcast(x, dist.get_global_rank(group, source), group=group)
    return x


def reduce_numbers(values, group, op=dist.ReduceOp.SUM):
    """Python numbers in, reduced over the group out (a list of floats): one all-reduce of a
    float64 tensor made on the group's device."""
    t = torch.tensor(list(values), dtype=torch.float64, device=group_device(group))
    return all_reduce_(t, group, op).tolist()


def all_gather_objects(obj, group):
    """[obj of group rank 0, obj of rank 1, ...] on every rank (pickled; for rare, small data).
    torch moves the pickles on the device `torch.cuda.set_device` chose, under NCCL."""
    if group_size(group) == 1:
        return [obj]
    every = [None] * group_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def barrier(group):
    """Every rank of the group gets here before any leaves; on NCCL, on this rank's GPU."""
    device = group_device(group)
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
