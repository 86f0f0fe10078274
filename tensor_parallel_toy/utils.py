"""The TP-aware gradient norm."""
import torch
import torch.distributed as dist

from .comm import group_size


def grad_norm(model, tp_group=None):
    """Global L2 norm of all gradients, as if the model were not split.

    A sharded parameter (metadata `tensor_parallel_dim` set) has a different slice of its
    gradient on each rank: square-sum locally, then sum over the group. A replicated parameter
    has the same full gradient on every rank (after the sequence-parallel reduction): count it
    once, not p times. Call it before the gradients are cleared.
    """
    device = next(model.parameters()).device
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for param in model.parameters():
        if param.grad is None:
            continue
        sq = param.grad.detach().double().pow(2).sum()
        if getattr(param, "tensor_parallel_dim", None) is not None:
            sharded += sq
        else:
            replicated += sq
    if group_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return (sharded + replicated).sqrt().item()
