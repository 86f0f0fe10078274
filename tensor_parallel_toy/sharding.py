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
init_std
    std of the model's normal init; None: keep the values built (a norm's ones)
    set by:  mark_init_std (model.py)
    read by: init_std (Transformer.reset_parameters)

Wrapping engines replace Parameter objects: `fully_shard` swaps each for a new DTensor
Parameter, and attributes on the old one are gone. They keep the modules and the parameter
names, so `record_layouts` copies the marks into a `Layout` per parameter, held by the module
that owns it; `named_layouts` reads them back from a wrapped model or a bare one.
"""
import zlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from .comm import all_gather_dim, all_reduce_, group_rank, group_size

DEFAULT_INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------
# Marking
# ----------------------------------------------------------------------------------------------
def mark_tensor_parallel(param, dim):
    """`param` is split over the TP ranks along `dim` (None: replicated). Returns `param`."""
    param.tensor_parallel_dim = dim
    return param


def mark_init_std(param, std):
    """The std of `param`'s normal init in `Transformer.reset_parameters` (None: keep it)."""
    param.init_std = std
    return param


def tensor_parallel_dim(param):
    """The dim `param` (a parameter or its `Layout`) is split along, or None when every rank
    holds all of it."""
    return getattr(param, "tensor_parallel_dim", None)


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


def layout_of(param):
    """The `Layout` read from the marks on `param` itself."""
    return Layout(tensor_parallel_dim(param), init_std(param))


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
    dim = tensor_parallel_dim(layout or param)
    if dim is not None:
        shape[dim] *= tp_size
    return shape


def shard(full, param, group, layout=None):
    """This rank's slice of the full tensor `full`, in `param`'s layout (or `layout`)."""
    dim, p = tensor_parallel_dim(layout or param), group_size(group)
    if dim is None or p == 1:
        return full
    return full.chunk(p, dim=dim)[group_rank(group)]


def unshard(local, param, group, layout=None):
    """The full tensor from every rank's `local` slice (a collective: every rank calls it)."""
    dim = tensor_parallel_dim(layout or param)
    if dim is None or group_size(group) == 1:
        return local
    return all_gather_dim(local, dim, group)


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
    each rank: square-sum locally, then sum over the group. A replicated parameter has the same
    full gradient on every rank (its sequence-parallel partial sums were added up in backward):
    count it once, not p times. Under `fully_shard` (root wrapped) every gradient is also split
    over the data-parallel ranks, a DTensor: its squares are summed over the DP group first.
    Call it before the gradients are cleared.
    """
    device = next(model.parameters()).device
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # [TP-sharded, replicated]
    dp_group = None
    for _, param, layout in named_layouts(model):
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):  # this DP rank's shard of it
            dp_group, grad = grad.device_mesh.get_group(), grad.to_local()
        replicated = tensor_parallel_dim(layout) is None
        squares[int(replicated)] += grad.detach().double().pow(2).sum()
    all_reduce_(squares, dp_group)  # None (no FSDP): nothing to add
    all_reduce_(squares[:1], tp_group)  # the sharded part only
    return squares.sum().sqrt().item()


__all__ = ["Layout", "full_shape", "gather_data_parallel", "grad_norm", "init_from_full_",
           "init_std", "layout_of", "draw_full_weights_", "mark_init_std",
           "mark_tensor_parallel", "named_layouts", "record_layouts", "scatter_data_parallel",
           "shard", "tensor_parallel_dim", "unshard"]
