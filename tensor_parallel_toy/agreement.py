"""What the ranks of a TP group must agree on, checked: the model they build and the batch they feed it.

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
import torch.distributed as dist

from .comm import all_gather_dim, group_size

_SHOWN_FIELDS = 3  # a mismatch names this many fields (the first ones), then counts the rest


class RanksDisagreeError(ValueError):
    """The ranks of a group built different models or were given different batches."""


def _group_device(group):
    """Where a tensor must live to travel over `group`: its GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest(fields):
    """A 64-bit digest of the fields' names and values that is the same in every process
    (Python's own hash() of a string is salted per process)."""
    text = repr(sorted((str(k), repr(v)) for k, v in fields.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def _by_value(values):
    """[value of rank 0, value of rank 1, ...] -> "32 on rank 0, 64 on ranks 1, 2"."""
    ranks = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(str(rank))
    return ", ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {', '.join(r)}"
                     for value, r in ranks.items())


def module_fingerprint(module, **fields):
    """`fields`, then the local shape and dtype of every parameter and buffer of `module`, by
    name: what the ranks of a TP group must agree on about a module they build together."""
    fingerprint = dict(fields)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        fingerprint[name] = f"{list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
    return fingerprint


def check_ranks_agree(fields, group, what):
    """Raise `RanksDisagreeError` on every rank of `group` unless every rank passed equal
    `fields` (name -> value with a stable repr, e.g. `module_fingerprint(...)`).

    Cost: one all-gather of one int64 per rank. Only when the digests differ is there a second
    collective (an all_gather_object of the fields), to name what differs. Every rank must call
    it, in the same order as its other collectives; a group of one rank returns at once.
    """
    p = group_size(group)
    if p == 1:
        return
    mine = torch.tensor([_digest(fields)], dtype=torch.int64, device=_group_device(group))
    digests = all_gather_dim(mine, 0, group).tolist()  # [p]
    if len(set(digests)) == 1:
        return
    every = [None] * p
    dist.all_gather_object(every, dict(fields), group=group)  # only on a mismatch
    names = list(dict.fromkeys(name for f in every for name in f))  # the first rank's order
    differ = [n for n in names if len({repr(f.get(n, "<absent>")) for f in every}) > 1]
    shown = "; ".join(f"{n}: {_by_value([f.get(n, '<absent>') for f in every])}"
                      for n in differ[:_SHOWN_FIELDS])
    more = f" (and {len(differ) - _SHOWN_FIELDS} more)" if len(differ) > _SHOWN_FIELDS else ""
    if not differ:  # equal values whose repr differs only in their order: say so, still refuse
        shown = "the same fields in a different order"
    raise RanksDisagreeError(f"the {p} ranks of the tensor-parallel group built different "
                             f"{what}: {shown}{more}")
