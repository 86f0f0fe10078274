"""What the ranks of a TP group must agree on, checked: the model they build, the batch they use.

Each rank of a tensor-parallel group holds a slice of one model and sees the whole batch. Two
mistakes are invisible to a rank on its own:

- ranks that build *different* models (another config on one rank, another dtype) run
  collectives of different sizes, or in a different order, and hang or fail far from the cause;
- ranks given *different* batches compute a loss that is the loss of no batch at all, and
  return it without complaint.

Both are cheap to catch. At construction the ranks exchange a digest of what must agree (one
all-gather of one int64 per rank); only when the digests differ do they exchange the values
themselves, to name the field and each rank's value (`check_ranks_agree`, `module_fingerprint`).
At every call the model either compares a checksum of the batch over the group (one all-gather
of a few int64s) or broadcasts TP rank 0's batch to the others, Megatron-LM's way
(`agree_on_batch`). Every rank reaches the same verdict, so every rank raises the same error.
"""
import hashlib

import torch

from ..comm import all_gather_dim, group_rank, group_size
from .collectives import all_gather_objects, broadcast_, group_device

SAME_BATCH = ("check", "broadcast")
_SHOWN_FIELDS = 3  # a mismatch names this many fields (the first ones), then counts the rest


class RanksDisagreeError(ValueError):
    """The ranks of a group built different models or were given different batches."""


def digest(fields):
    """A 64-bit digest of the fields' names and values that is the same in every process
    (Python's own hash() of a string is salted per process)."""
    text = repr(sorted((str(k), repr(v)) for k, v in fields.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def by_value(values):
    """[value of rank 0, value of rank 1, ...] -> "32 on rank 0, 64 on ranks 1, 2"."""
    ranks, shown = {}, {}
    for rank, value in enumerate(values):
        ranks.setdefault(repr(value), []).append(str(rank))  # repr: lists are values too
        shown.setdefault(repr(value), value)
    return ", ".join(f"{shown[key]} on rank{'s' if len(r) > 1 else ''} {', '.join(r)}"
                     for key, r in ranks.items())


def module_fingerprint(module, **fields):
    """`fields`, then the local shape and dtype of every parameter and buffer of `module`, by
    name: what the ranks of a TP group must agree on about a module they build together."""
    fingerprint = dict(fields)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        fingerprint[name] = f"{list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
    return fingerprint


def check_ranks_agree(fields, group, what):
    """Raise `RanksDisagreeError` on every rank of `group` unless every rank passed equal
    `fields` (name -> a picklable value whose repr is the same in every process: numbers,
    strings, tuples; e.g. `module_fingerprint(...)`).

    Cost: one all-gather of one int64 per rank. Only when the digests differ is there a second
    collective (an all_gather_object of the fields), to name what differs. Every rank must call
    it, in the same order as its other collectives; a group of one rank returns at once.
    """
    p = group_size(group)
    if p == 1:
        return
    mine = torch.tensor([digest(fields)], dtype=torch.int64, device=group_device(group))
    digests = all_gather_dim(mine, 0, group).tolist()  # [p]
    if len(set(digests)) == 1:
        return
    every = all_gather_objects(dict(fields), group)  # only on a mismatch
    names = list(dict.fromkeys(name for f in every for name in f))  # the first rank's order
    differ = [n for n in names if len({repr(f.get(n, "<absent>")) for f in every}) > 1]
    shown = "; ".join(f"{n}: {by_value([f.get(n, '<absent>') for f in every])}"
                      for n in differ[:_SHOWN_FIELDS])
    more = f" (and {len(differ) - _SHOWN_FIELDS} more)" if len(differ) > _SHOWN_FIELDS else ""
    raise RanksDisagreeError(f"the {p} ranks of the tensor-parallel group built different "
                             f"{what}: {shown}{more}")


# ----------------------------------------------------------------------------------------------
# The batch
# ----------------------------------------------------------------------------------------------
def check_same_batch_option(same_batch):
    if same_batch not in SAME_BATCH:
        raise ValueError(f"same_batch={same_batch!r}: valid are 'check' (every rank passes the "
                         f"same batch, checked) and 'broadcast' (TP rank 0's batch is used)")


def _checksum(t):
    """An int64 checksum of an integer tensor's values and their positions, computed where the
    tensor lives (no host read): sum of value_i * w_i with odd weights that vary with i."""
    flat = t.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    weights = (weights * 0x9E3779B1 + 0x7F4A7C15) | 1  # odd: each value counts
    return (flat * weights).sum()  # wraps around in int64, the same way on every rank


def _header(tensors, with_values):
    """What every rank compares: per tensor its ndim, 4 dims (0-padded), and its checksum."""
    parts = []
    for t in tensors:
        shape = list(t.shape)[:4] + [0] * (4 - min(t.dim(), 4))
        parts.append(torch.tensor([t.dim(), *shape], dtype=torch.int64, device=t.device))
        value = _checksum(t) if with_values else torch.zeros((), dtype=torch.int64,
                                                             device=t.device)
        parts.append(value.reshape(1))
    return torch.cat(parts)  # [6 * len(tensors)]


def agree_on_batch(batch, group, same_batch):
    """Make sure every rank of `group` holds the same `batch`, {name: integer tensor} (e.g.
    input_ids and labels).

    same_batch="check": one all-gather of 6 int64s per tensor (shape and checksum) and one host
    read of the verdict (on a GPU, a device sync); different batches raise `RanksDisagreeError`
    on every rank, naming each rank's shapes or checksums.
    same_batch="broadcast": the shapes are compared the same way (they must match: every rank
    passes a batch of the same shape), then TP rank 0's values are broadcast and copied into
    the other ranks' tensors, in place, as `dist.broadcast` itself does: one more collective
    of the batch's bytes.
    """
    if group_size(group) == 1:
        return
    names, tensors = list(batch), list(batch.values())
    device = group_device(group)
    header = _header(tensors, same_batch == "check").to(device)
    every = all_gather_dim(header.unsqueeze(0), 0, group)  # [p, 6 * len(tensors)]
    if not bool((every == every[0]).all()):  # the one host read
        every = every.view(every.shape[0], len(tensors), 6).tolist()
        for i, name in enumerate(names):
            shapes = [tuple(r[i][1:1 + r[i][0]]) if r[i][0] <= 4 else f"{r[i][0]}-d"
                      for r in every]
            if len(set(shapes)) > 1:
                raise RanksDisagreeError(
                    f"the ranks of the tensor-parallel group were given {name} of different "
                    f"shapes: {by_value(shapes)}; every TP rank needs the same batch")
        for i, name in enumerate(names):
            sums = [r[i][5] for r in every]
            if len(set(sums)) > 1:
                raise RanksDisagreeError(
                    f"the ranks of the tensor-parallel group were given different {name} "
                    f"(checksums: {by_value(sums)}); give every TP rank the same batch, or "
                    f"build the model with same_batch='broadcast' to use TP rank 0's")
    if same_batch == "broadcast":
        _broadcast_from_first_rank(tensors, group, device)


def _broadcast_from_first_rank(tensors, group, device):
    """One broadcast of every tensor, packed into one int64 buffer, from the group's rank 0."""
    packed = torch.cat([t.reshape(-1).to(device, torch.int64) for t in tensors])
    broadcast_(packed, 0, group)
    if group_rank(group) != 0:
        for t, received in zip(tensors, packed.split([t.numel() for t in tensors])):
            t.copy_(received.view(t.shape))
