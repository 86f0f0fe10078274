"""Parameter metadata: how a parameter is split over the TP ranks, and what follows from it.

Code that must treat parameters differently (load a checkpoint, gather a state dict, sum a
gradient, count a gradient in the norm) reads these attributes, never a parameter's name or
its module's class, so it also works for layers it has never seen. This is the one place that
sets and reads them:

tensor_parallel_dim
    the dim split over the TP ranks; None or absent: replicated, the same on every rank
    set by:  mark_tensor_parallel (column, row, vocabulary and classic TP layers)
    read by: full_shape, shard, unshard (checkpoints, full state dicts and gradients),
             grad_norm, and classic_tp's sync_replicated_gradients
sequence_parallel
    replicated, but applied to this rank's s/p tokens only: each rank's gradient is a partial
    sum over the sequence
    set by:  mark_sequence_parallel (the RMSNorm weights)
    read by: register_sequence_parallel_grad_hooks
sp_grad_hooked
    the summing hook is registered (so it never is twice)
    set and read by: register_sequence_parallel_grad_hooks
init_std
    std of the model's normal init; None: keep the values built (a norm's ones)
    set by:  mark_init_std (model.py)
    read by: init_std (Transformer.reset_parameters)
"""
import torch

from .comm import all_gather_dim, all_reduce_, group_rank, group_size

DEFAULT_INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------
# Marking
# ----------------------------------------------------------------------------------------------
def mark_tensor_parallel(param, dim):
    """`param` is split over the TP ranks along `dim` (None: replicated). Returns `param`."""
    param.tensor_parallel_dim = dim
    return param


def mark_sequence_parallel(param):
    """A replicated parameter applied to sequence-parallel activations: each rank's gradient
    covers only its s/p tokens and must be summed over the TP group. Returns `param`."""
    param.sequence_parallel = True
    return param


def mark_init_std(param, std):
    """The std of `param`'s normal init in `Transformer.reset_parameters` (None: keep it)."""
    param.init_std = std
    return param


def tensor_parallel_dim(param):
    """The dim `param` is split along, or None when every rank holds all of it."""
    return getattr(param, "tensor_parallel_dim", None)


def init_std(param):
    return getattr(param, "init_std", DEFAULT_INIT_STD)


# ----------------------------------------------------------------------------------------------
# Full tensors <-> this rank's shards
# ----------------------------------------------------------------------------------------------
def full_shape(param, tp_size):
    """The shape of the whole parameter, of which `param` is this rank's shard."""
    shape = list(param.shape)
    dim = tensor_parallel_dim(param)
    if dim is not None:
        shape[dim] *= tp_size
    return shape


def shard(full, param, group):
    """This rank's slice of the full tensor `full`, in `param`'s layout."""
    dim, p = tensor_parallel_dim(param), group_size(group)
    if dim is None or p == 1:
        return full
    return full.chunk(p, dim=dim)[group_rank(group)]


def unshard(local, param, group):
    """The full tensor from every rank's `local` slice (a collective: every rank calls it)."""
    dim = tensor_parallel_dim(param)
    if dim is None or group_size(group) == 1:
        return local
    return all_gather_dim(local, dim, group)


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
def register_sequence_parallel_grad_hooks(module, group) -> int:
    """Sum, over the TP group, the gradient of every parameter marked `sequence_parallel`.

    A norm weight is replicated on every TP rank, but under SP each rank applies it to its own
    s/p tokens only, so each rank's gradient is a partial sum over the sequence. The hook sees
    the gradient of one backward pass before it is accumulated into `.grad`, so gradient
    accumulation over micro-batches stays correct (reducing `.grad` itself would re-add the
    already-reduced earlier micro-batches). Returns how many parameters got a hook.
    """
    if group_size(group) == 1:
        return 0
    hooked = 0
    for param in module.parameters():
        if getattr(param, "sequence_parallel", False) and not getattr(param, "sp_grad_hooked",
                                                                      False):
            param.register_hook(lambda grad: all_reduce_(grad.clone(), group))
            param.sp_grad_hooked = True
            hooked += 1
    return hooked


def grad_norm(model, tp_group=None):
    """Global L2 norm of all gradients, as if the model were not split.

    A sharded parameter (`tensor_parallel_dim` set) has a different slice of its gradient on
    each rank: square-sum locally, then sum over the group. A replicated parameter has the same
    full gradient on every rank (after the sequence-parallel reduction): count it once, not p
    times. Call it before the gradients are cleared.
    """
    device = next(model.parameters()).device
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for param in model.parameters():
        if param.grad is None:
            continue
        sq = param.grad.detach().double().pow(2).sum()
        if tensor_parallel_dim(param) is not None:
            sharded += sq
        else:
            replicated += sq
    all_reduce_(sharded, tp_group)
    return (sharded + replicated).sqrt().item()


__all__ = ["full_shape", "grad_norm", "init_from_full_", "init_std", "mark_init_std",
           "mark_sequence_parallel", "mark_tensor_parallel",
           "register_sequence_parallel_grad_hooks", "shard", "tensor_parallel_dim", "unshard"]
