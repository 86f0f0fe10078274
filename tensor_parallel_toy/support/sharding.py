"""Full tensors <-> shards, for any model whose layers record their parameters' layouts (the
kernel's layers do, on the module: `parallel_linear.Layout`, `set_layout`, `layout_of`).

Code that must treat parameters differently (load a checkpoint, gather a state dict, count a
gradient in the norm, check replicated gradients) reads the layouts, never a parameter's name
or its module's class, so it also works for layers it has never seen.

A layout is kept by the module that owns the parameter, not on the Parameter object: wrapping
engines replace Parameter objects (`fully_shard` swaps each for a new DTensor Parameter) but
keep the modules and the parameter names, so `named_layouts` reads the same layouts from a bare
model, from one wrapped by `fully_shard` or DDP by hand, and from one wrapped by the package.

The model's full weights and gradients: `load_full_state_dict(model, state_dict)`,
`full_state_dict(model)`, `full_grads(model)` (under the baseline's keys, on every rank).
"""
import functools

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from ..comm import all_gather_dim, all_reduce_, group_rank, group_size
from ..parallel_linear import Layout, full_shape, layout_of, shard


# ----------------------------------------------------------------------------------------------
# Reading the layouts
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)  # a few splits per model, asked on every gradient norm
def first_holder(split):
    """The lowest rank holding each full row of a `RowSplit`, `[full_rows]`."""
    ranks = torch.arange(len(split.rows)).unsqueeze(1).expand_as(split.rows)
    first = torch.full((int(split.rows.max()) + 1,), len(split.rows))
    return first.scatter_reduce(0, split.rows.flatten(), ranks.flatten(), "amin")


def counted_rows(split, rank):
    """A bool per row `rank` holds: True where it is the first rank holding that row (the
    checkpoint and the gradient norm count each row once, from there)."""
    return first_holder(split)[split.rows[rank]] == rank


def named_layouts(model):
    """(name, parameter, Layout) for every parameter of `model`, each once, in the order of
    `named_parameters`: the layout its module records (`layout_of`). Works on a bare model and
    on one wrapped by `fully_shard` or DDP (names then as the wrapper's `named_parameters`
    gives them)."""
    seen = set()
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight: listed once, under its first name
                continue
            seen.add(id(param))
            yield (f"{prefix}.{name}" if prefix else name), param, layout_of(module, name)


def layouts(model):
    """{name: Layout} of every parameter of `model` (see `named_layouts`)."""
    return {name: layout for name, _, layout in named_layouts(model)}


# ----------------------------------------------------------------------------------------------
# Full tensors <-> this rank's shards
# ----------------------------------------------------------------------------------------------
def unshard(local, layout, group):
    """The full tensor from every rank's `local` slice (a collective: every rank calls it)."""
    dim = layout.dim
    p = group_size(group)
    split = layout.rows
    if dim is None or p == 1:
        return local
    gathered = all_gather_dim(local, dim, group)
    if (layout.full_size or 0) % p:  # a padded vocabulary: the padding left out (a copy)
        return gathered.narrow(dim, 0, layout.full_size).clone()
    if split is None:
        return gathered
    # Every rank's rows put back in place; a row several ranks hold is taken from the first
    # of them (the copies are equal), so each row is written once.
    rows = split.rows.flatten()
    counted = torch.cat([counted_rows(split, r) for r in range(p)])
    full = gathered.new_empty(full_shape(local, layout, p))
    full[rows[counted].to(full.device)] = gathered[counted.to(full.device)]
    return full


def gather_data_parallel(t):
    """This TP rank's whole tensor from `t`: `t` itself, or, when `fully_shard` has split it
    over the data-parallel ranks (a DTensor), its shards all-gathered over them (a collective
    of the DP group)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def scatter_data_parallel(value, param):
    """`value` (this TP rank's whole tensor, the same on its DP peers) in `param`'s form: as
    is, or this DP rank's shard of it when `param` is a DTensor (no communication)."""
    if not isinstance(param, DTensor):
        return value
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


# ----------------------------------------------------------------------------------------------
# A model's full weights and gradients (the package's Transformer, or any module holding its
# `tp_group`), bare or wrapped by fully_shard or DDP, by the package or by hand
# ----------------------------------------------------------------------------------------------
def unwrapped(model):
    """The model inside a DDP wrapper (its names and its `tp_group` are the model's), or the
    model itself (`fully_shard` wraps in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@torch.no_grad()
def load_full_state_dict(model, state_dict):
    """Load a baseline `Transformer(config).state_dict()` (full tensors under the baseline's
    keys) into `model`, each rank keeping its shards."""
    model = unwrapped(model)
    group = model.tp_group
    for name, param, layout in named_layouts(model):
        full = state_dict[name]
        shape = full_shape(param, layout, group_size(group))  # a DTensor's shape is its whole
        if list(full.shape) != shape:
            raise ValueError(f"{name}: checkpoint shape {list(full.shape)} does not match "
                             f"the model's full shape {shape}")
        local = shard(full.to(param.device, param.dtype), layout, group)
        param.copy_(scatter_data_parallel(local, param))
    return model


@torch.no_grad()
def full_state_dict(model):
    """Full (unsharded) parameters under the baseline's keys, on every rank (a collective)."""
    model = unwrapped(model)
    return {n: unshard(gather_data_parallel(p.detach()), layout, model.tp_group)
            for n, p, layout in named_layouts(model)}


@torch.no_grad()
def full_grads(model):
    """Full (unsharded) gradients under the baseline's keys, on every rank (a collective)."""
    model = unwrapped(model)
    return {n: None if p.grad is None else
            unshard(gather_data_parallel(p.grad), layout, model.tp_group)
            for n, p, layout in named_layouts(model)}


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def grad_norm(model, tp_group=None):
    """Global L2 norm of all gradients, as if the model were not split.

    A sharded parameter (its layout's `dim` set) has a different slice of its gradient on
    each rank: square-sum locally, then sum over the group; rows that several ranks hold (see
    `RowSplit`: their gradients were summed over them in backward) count on the first of them
    only. A replicated parameter has the same full gradient on every rank (its
    sequence-parallel partial sums were added up in backward): count it once, not p times.
    Under `fully_shard` (root wrapped) every gradient is also split over the data-parallel
    ranks, a DTensor: its squares are summed over the DP group first. Call it before the
    gradients are cleared.
    """
    device = next(model.parameters()).device
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # [TP-sharded, replicated]
    dp_group = None
    rank = group_rank(tp_group)
    for _, param, layout in named_layouts(model):
        grad = param.grad
        if grad is None:
            continue
        split = layout.rows
        shares = split is not None and split.shared(rank) is not None
        counted = counted_rows(split, rank).to(device) if shares else None
        if isinstance(grad, DTensor):  # this DP rank's shard of it (and of its rows)
            if counted is not None:
                counted = scatter_data_parallel(counted, grad).to_local()
            dp_group, grad = grad.device_mesh.get_group(), grad.to_local()
        grad = grad.detach().double()
        if counted is not None:
            grad = grad[counted]
        replicated = layout.dim is None
        squares[int(replicated)] += grad.pow(2).sum()
    all_reduce_(squares, dp_group)  # None (no FSDP): nothing to add
    all_reduce_(squares[:1], tp_group)  # the sharded part only
    return squares.sum().sqrt().item()


__all__ = ["Layout", "counted_rows", "first_holder", "full_grads", "full_state_dict",
           "gather_data_parallel", "grad_norm", "layout_of", "layouts", "load_full_state_dict",
           "named_layouts", "scatter_data_parallel", "unshard", "unwrapped"]
