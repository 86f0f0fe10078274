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
tensor_parallel_view
    a `SplitView`: dim 0 flattens an output shape (gate and up `(2, f)`; q, k, v
    `(kv heads, q heads per kv head + 2, head_dim)`) that is split along one of its own dims,
    so a rank's rows are not one contiguous block of the full tensor's; some rows may be held
    by several ranks (k/v heads shared when there are fewer of them than ranks)
    set by:  mark_tensor_parallel (ColumnParallelLinear given an output shape)
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
@dataclass(frozen=True)
class SplitView:
    """Which rows of a full tensor each TP rank holds, when its dim 0 flattens `shape`.

    `shape` is split along `split_dim` into p equal slices, slice r on rank r. When
    `shape[split_dim]` is smaller than p (it must then divide p), p / shape[split_dim] ranks
    share each slice (split_dim 0 only): they split the slice's next dim, except its last
    `shared_tail` entries, which each of them holds whole. Attention's q, k, v rows
    `(nkv, g + 2, hd)` with shared_tail=2: ranks sharing a k/v head each take their own query
    heads of its g, and all of them its k and v.
    """
    shape: tuple
    split_dim: int
    shared_tail: int = 0

    def ranks_per_slice(self, p):
        """How many ranks hold each slice of the split dim (1: none is shared)."""
        n = self.shape[self.split_dim]
        return 1 if n % p == 0 else p // n

    def check(self, p, name="out_features"):
        """One ValueError naming the shape and p unless p ranks can split it this way."""
        n, d = self.shape[self.split_dim], self.split_dim
        if n % p == 0:
            return
        s = p // n if p % n == 0 else 0
        if s and d == 0 and len(self.shape) > 1 and self.shared_tail and \
                (self.shape[1] - self.shared_tail) % s == 0:
            return
        raise ValueError(f"{name}={tuple(self.shape)} split along dim {d} over the "
                         f"tensor-parallel size {p}: {n} must be a multiple of {p}, or (dim 0, "
                         f"shared_tail > 0) divide {p} into groups of ranks that split the rest "
                         f"of dim 1 evenly")

    def local_shape(self, p):
        """This rank's part of `shape` (the same on every rank)."""
        shape, s = list(self.shape), self.ranks_per_slice(p)
        shape[self.split_dim] = max(shape[self.split_dim] // p, 1)
        if s > 1:
            shape[1] = (shape[1] - self.shared_tail) // s + self.shared_tail
        return shape

    def rows(self, rank, p):
        """The full tensor's dim-0 indices that `rank` holds, in its order (a LongTensor)."""
        ids = torch.arange(math.prod(self.shape)).view(self.shape)
        s = self.ranks_per_slice(p)
        if s == 1:
            return ids.chunk(p, dim=self.split_dim)[rank].flatten()
        mine = ids[rank // s]  # [shape[1], ...]: the slice of dim 0 these s ranks share
        own = mine.shape[0] - self.shared_tail
        return torch.cat([mine[:own].chunk(s)[rank % s], mine[own:]]).flatten()

    def first_shared_row(self, p):
        """The local row from which on every row is also held by the other ranks of its slice
        (the shared tail), or None when no row is shared."""
        if self.ranks_per_slice(p) == 1:
            return None
        local = self.local_shape(p)
        return (local[1] - self.shared_tail) * math.prod(local[2:])

    def counted(self, rank, p):
        """A bool per local row: True unless another rank (the first of its slice) holds
        the row too, so that a sum over ranks counts every row once."""
        n = math.prod(self.local_shape(p))
        counted = torch.ones(n, dtype=torch.bool)
        if self.ranks_per_slice(p) > 1 and rank % self.ranks_per_slice(p):
            counted[self.first_shared_row(p):] = False
        return counted


def mark_tensor_parallel(param, dim, view=None):
    """`param` is split over the TP ranks along `dim` (None: replicated), its rows laid out as
    `view` (a `SplitView`; with dim 0) when it is given. Returns `param`."""
    param.tensor_parallel_dim = dim
    if view is not None:
        param.tensor_parallel_view = view
    return param


def mark_init_std(param, std):
    """The std of `param`'s normal init in `Transformer.reset_parameters` (None: keep it)."""
    param.init_std = std
    return param


def tensor_parallel_dim(param):
    """The dim `param` (a parameter or its `Layout`) is split along, or None when every rank
    holds all of it."""
    return getattr(param, "tensor_parallel_dim", None)


def tensor_parallel_view(param):
    """The `SplitView` of `param` (a parameter or its `Layout`), or None: a plain split."""
    return getattr(param, "tensor_parallel_view", None)


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
    tensor_parallel_view: SplitView | None = None


def layout_of(param):
    """The `Layout` read from the marks on `param` itself."""
    return Layout(tensor_parallel_dim(param), init_std(param), tensor_parallel_view(param))


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
    dim, view = tensor_parallel_dim(layout or param), tensor_parallel_view(layout or param)
    if view is not None:
        shape[0] = math.prod(view.shape)
    elif dim is not None:
        shape[dim] *= tp_size
    return shape


def shard(full, param, group, layout=None):
    """This rank's slice of the full tensor `full`, in `param`'s layout (or `layout`)."""
    dim, p = tensor_parallel_dim(layout or param), group_size(group)
    view = tensor_parallel_view(layout or param)
    if dim is None or p == 1:
        return full
    if view is not None:
        return full[view.rows(group_rank(group), p).to(full.device)]
    return full.chunk(p, dim=dim)[group_rank(group)]


def unshard(local, param, group, layout=None):
    """The full tensor from every rank's `local` slice (a collective: every rank calls it)."""
    dim, p = tensor_parallel_dim(layout or param), group_size(group)
    view = tensor_parallel_view(layout or param)
    if dim is None or p == 1:
        return local
    gathered = all_gather_dim(local, dim, group)
    if view is None:
        return gathered
    # Every rank's rows put back in place; a shared row is taken from the first rank of its
    # slice (the copies are equal), so each row is written once.
    rows = torch.cat([view.rows(r, p) for r in range(p)])
    counted = torch.cat([view.counted(r, p) for r in range(p)])
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
    each rank: square-sum locally, then sum over the group; rows that several ranks hold (a
    `SplitView`'s shared tail, whose gradients were summed over them in backward) count on the
    first of them only. A replicated parameter has the same full gradient on every rank (its
    sequence-parallel partial sums were added up in backward): count it once, not p times.
    Under `fully_shard` (root wrapped) every gradient is also split over the data-parallel
    ranks, a DTensor: its squares are summed over the DP group first. Call it before the
    gradients are cleared.
    """
    device = next(model.parameters()).device
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # [TP-sharded, replicated]
    dp_group = None
    p, rank = group_size(tp_group), group_rank(tp_group)
    for _, param, layout in named_layouts(model):
        grad = param.grad
        if grad is None:
            continue
        view = tensor_parallel_view(layout)
        shares = view is not None and view.ranks_per_slice(p) > 1
        counted = view.counted(rank, p).to(device) if shares else None
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


__all__ = ["Layout", "SplitView", "full_shape", "gather_data_parallel", "grad_norm",
           "init_from_full_", "init_std", "layout_of", "draw_full_weights_", "mark_init_std",
           "mark_tensor_parallel", "named_layouts", "record_layouts", "scatter_data_parallel",
           "shard", "tensor_parallel_dim", "tensor_parallel_view", "unshard"]
