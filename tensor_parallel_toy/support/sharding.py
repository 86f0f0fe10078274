"""Parameter metadata: how a parameter is split over the TP ranks, and what follows from it.

Code that must treat parameters differently (load a checkpoint, gather a state dict, count a
gradient in the norm) reads this metadata, never a parameter's name or its module's class, so
it also works for layers it has never seen. This is the one place that sets and reads it.

A layer marks its parameters when it builds them (attributes on the Parameter):

tensor_parallel_dim
    the dim split over the TP ranks; None or absent: replicated, the same on every rank
    set by:  mark_tensor_parallel (column, row, vocabulary and classic TP layers)
    read by: full_shape, shard, unshard (checkpoints, full state dicts and gradients),
             grad_norm, and classic_tp's sync_replicated_gradients
tensor_parallel_rows
    a `RowSplit`: which rows of the full tensor each rank holds, when they are not one
    contiguous block per rank: the rows of an output shape split along one of its own dims
    (gate and up `(2, f)` split along f: `split_rows`), or attention's q, k, v when there are
    fewer k/v heads than ranks (some rows then held by several ranks: model.qkv_rows)
    set by:  mark_tensor_parallel (ColumnParallelLinear given a shape or rows)
    read by: the same as tensor_parallel_dim, which is then 0
init_std
    std of the model's normal init; None: keep the values built (a norm's ones)
    set by:  mark_init_std (model.py)
    read by: init_std (Transformer.reset_parameters)

Wrapping engines replace Parameter objects: `fully_shard` swaps each for a new DTensor
Parameter, and attributes on the old one are gone. They keep the modules and the parameter
names, so `record_layouts` copies the marks into a `Layout` per parameter, held by the module
that owns it; `named_layouts` reads them back from a wrapped model or a bare one.
"""
import functools
import math
import zlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..comm import all_gather_dim, all_reduce_, group_rank, group_size

DEFAULT_INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------
# Marking
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RowSplit:
    """Which rows (dim 0) of a full tensor each TP rank holds: `rows[r]`, rank r's rows in the
    order it keeps them (an int64 tensor `[p, n]`: the same number on every rank).

    A row may be held by several ranks. Their copies are equal, and a layer that uses such a
    weight sends it through `f` over the ranks holding each row (comm.copy_to_row_holders), so
    its gradient is the sum of their partial ones; the checkpoint and the gradient norm count
    each row once, from the first rank holding it.
    """
    rows: torch.Tensor

    @property
    def full_rows(self):
        return int(self.rows.max()) + 1

    @functools.cached_property
    def first_holder(self):
        """The lowest rank holding each full row, `[full_rows]` (computed once)."""
        ranks = torch.arange(len(self.rows)).unsqueeze(1).expand_as(self.rows)
        first = torch.full((self.full_rows,), len(self.rows))
        return first.scatter_reduce(0, self.rows.flatten(), ranks.flatten(), "amin")

    def counted(self, rank):
        """A bool per row of `rank`: True where it is the first rank holding that row."""
        return self.first_holder[self.rows[rank]] == rank

    def shared(self, rank):
        """(local, slot, n): this rank's rows that other ranks hold too (local indices), their
        positions among all n such rows of the full tensor; None when no row is shared."""
        every = torch.nonzero(torch.bincount(self.rows.flatten()) > 1).flatten()
        if len(every) == 0:
            return None
        local = torch.nonzero(torch.isin(self.rows[rank], every)).flatten()
        return local, torch.searchsorted(every, self.rows[rank][local]), len(every)


def split_rows(shape, split_dim, p, name="out_features"):
    """The `RowSplit` of a tensor whose dim 0 flattens `shape`, split along `split_dim` of it
    into p equal slices, slice r on rank r (gate and up `(2, f)` along f). One ValueError
    naming the shape and p unless p divides that dim."""
    if shape[split_dim] % p:
        raise ValueError(f"{name}={tuple(shape)} split along dim {split_dim} over the "
                         f"tensor-parallel size {p}: {shape[split_dim]} must be a multiple of "
                         f"{p}")
    ids = torch.arange(math.prod(shape)).view(shape)
    return RowSplit(torch.stack([c.flatten() for c in ids.chunk(p, dim=split_dim)]))


def mark_tensor_parallel(param, dim, rows=None):
    """`param` is split over the TP ranks along `dim` (None: replicated), each rank holding
    the rows `rows` says (a `RowSplit`; with dim 0) when it is given. Returns `param`."""
    param.tensor_parallel_dim = dim
    if rows is not None:
        param.tensor_parallel_rows = rows
    return param


def mark_init_std(param, std):
    """The std of `param`'s normal init in `Transformer.reset_parameters` (None: keep it)."""
    param.init_std = std
    return param


def tensor_parallel_dim(param):
    """The dim `param` (a parameter or its `Layout`) is split along, or None when every rank
    holds all of it."""
    return getattr(param, "tensor_parallel_dim", None)


def tensor_parallel_rows(param):
    """The `RowSplit` of `param` (a parameter or its `Layout`), or None: a plain split."""
    return getattr(param, "tensor_parallel_rows", None)


def init_std(param):
    return getattr(param, "init_std", DEFAULT_INIT_STD)


# ----------------------------------------------------------------------------------------------
# Layouts: the marks, kept on the modules where wrapping cannot drop them
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One parameter's marks (see the table at the top)."""
    tensor_parallel_dim: int | None = None
    init_std: float | None = DEFAULT_INIT_STD
    tensor_parallel_rows: RowSplit | None = None


def layout_of(param):
    """The `Layout` read from the marks on `param` itself."""
    return Layout(tensor_parallel_dim(param), init_std(param), tensor_parallel_rows(param))


def record_layouts(model):
    """Copy the marks of every parameter into `param_layouts` ({name: Layout}) of the module
    that owns it. Call once the model is built, before any engine wraps it. Returns `model`."""
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if own:
            module.param_layouts = {name: layout_of(p) for name, p in own.items()}
    return model


def named_layouts(model):
    """(name, parameter, Layout) for every parameter of `model`, each once, in the order of
    `named_parameters`: the layout recorded on its module, else the marks on the parameter.
    Works on a bare model and on one wrapped by `fully_shard` or DDP (names then as the
    wrapper's `named_parameters` gives them)."""
    seen = set()
    for prefix, module in model.named_modules():
        recorded = getattr(module, "param_layouts", {})
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight: listed once, under its first name
                continue
            seen.add(id(param))
            layout = recorded.get(name) or layout_of(param)
            yield (f"{prefix}.{name}" if prefix else name), param, layout


# ----------------------------------------------------------------------------------------------
# Initialisation: every full weight drawn once, each rank keeping its shard
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def draw_full_weights_(model, tp_group, seed=0):
    """Draw every *full* weight of `model` from its own generator (seeded by seed and name)
    and keep this rank's shard, so any TP size starts from exactly the baseline's weights.
    A parameter whose init std is None (`mark_init_std`) keeps the values it was built with."""
    for name, param, layout in named_layouts(model):
        std = init_std(layout)
        if std is None:
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.randn(full_shape(param, group_size(tp_group), layout), generator=gen) * std
        local = shard(full, param, tp_group, layout)
        param.copy_(scatter_data_parallel(local.to(param.device, param.dtype), param))


# ----------------------------------------------------------------------------------------------
# Full tensors <-> this rank's shards
# ----------------------------------------------------------------------------------------------
def full_shape(param, tp_size, layout=None):
    """The shape of the whole parameter, of which `param` is this rank's shard (`layout`: its
    recorded Layout; by default the marks on `param`)."""
    shape = list(param.shape)
    dim, split = tensor_parallel_dim(layout or param), tensor_parallel_rows(layout or param)
    if split is not None:
        shape[0] = split.full_rows
    elif dim is not None:
        shape[dim] *= tp_size
    return shape


def shard(full, param, group, layout=None):
    """This rank's slice of the full tensor `full`, in `param`'s layout (or `layout`)."""
    dim, p = tensor_parallel_dim(layout or param), group_size(group)
    split = tensor_parallel_rows(layout or param)
    if dim is None or p == 1:
        return full
    if split is not None:
        return full[split.rows[group_rank(group)].to(full.device)]
    return full.chunk(p, dim=dim)[group_rank(group)]


def unshard(local, param, group, layout=None):
    """The full tensor from every rank's `local` slice (a collective: every rank calls it)."""
    dim, p = tensor_parallel_dim(layout or param), group_size(group)
    split = tensor_parallel_rows(layout or param)
    if dim is None or p == 1:
        return local
    gathered = all_gather_dim(local, dim, group)
    if split is None:
        return gathered
    # Every rank's rows put back in place; a row several ranks hold is taken from the first
    # of them (the copies are equal), so each row is written once.
    rows = split.rows.flatten()
    counted = torch.cat([split.counted(r) for r in range(p)])
    full = gathered.new_empty(full_shape(local, p, layout or param))
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


@torch.no_grad()
def init_from_full_(param, init, group):
    """Fill `param` with this rank's slice of one full tensor that `init(full)` fills in place.

    Every rank draws the same full tensor (from the same generator state, as after the same
    `torch.manual_seed`) and keeps its slice, so the shards together are one layer initialised
    exactly as its unsplit version would be, and the generator stays in step across ranks. The
    full tensor exists on every rank for a moment, on `param`'s device: fine for this package's
    sizes, a cost to avoid (draw on the CPU, or shard by shard) for a model near memory limits.
    """
    full = torch.empty(full_shape(param, group_size(group)), device=param.device,
                       dtype=param.dtype)
    init(full)
    param.copy_(shard(full, param, group))
    return param


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def grad_norm(model, tp_group=None):
    """Global L2 norm of all gradients, as if the model were not split.

    A sharded parameter (`tensor_parallel_dim` set) has a different slice of its gradient on
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
        split = tensor_parallel_rows(layout)
        shares = split is not None and split.shared(rank) is not None
        counted = split.counted(rank).to(device) if shares else None
        if isinstance(grad, DTensor):  # this DP rank's shard of it (and of its rows)
            if counted is not None:
                counted = scatter_data_parallel(counted, grad).to_local()
            dp_group, grad = grad.device_mesh.get_group(), grad.to_local()
        grad = grad.detach().double()
        if counted is not None:
            grad = grad[counted]
        replicated = tensor_parallel_dim(layout) is None
        squares[int(replicated)] += grad.pow(2).sum()
    all_reduce_(squares, dp_group)  # None (no FSDP): nothing to add
    all_reduce_(squares[:1], tp_group)  # the sharded part only
    return squares.sum().sqrt().item()


__all__ = ["Layout", "RowSplit", "split_rows", "full_shape", "gather_data_parallel", "grad_norm",
           "init_from_full_", "init_std", "layout_of", "draw_full_weights_", "mark_init_std",
           "mark_tensor_parallel", "named_layouts", "record_layouts", "scatter_data_parallel",
           "shard", "tensor_parallel_dim", "tensor_parallel_rows", "unshard"]
