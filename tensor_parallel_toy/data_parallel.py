"""2D parallelism: data parallel (DP) across copies of a tensor-parallel (TP) model.

The world is a dp x tp grid of ranks; global rank = dp_index * tp + tp_index:

                 tp_index 0   tp_index 1
    dp_index 0:    rank 0       rank 1      <- a TP group: one model, split in two
    dp_index 1:    rank 2       rank 3      <- another TP group: a second copy of it
                     ^            ^
                 DP groups: the same shard of the model in each copy

TP groups are runs of consecutive ranks, so under torchrun they stay inside one machine, where
the links are fastest; DP traffic (one gradient all-reduce per step) crosses machines.

One training step:
1. every rank of a TP group gets the same DP slice of the global batch (`split_batch`);
2. forward and backward inside the TP group, as for a single TP model;
3. the gradients are averaged over the DP group (`average_gradients`): each rank averages its
   own shard with the same shard of the other copies.
With `data_parallel_loss` the result is exactly the loss and gradients of the whole batch on
one device.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_reduce_, average_over_group_, group_rank, group_size


@dataclass(frozen=True)
class Mesh2D:
    """This rank's place in the dp x tp grid and its two process groups."""
    dp_size: int
    tp_size: int
    dp_rank: int
    tp_rank: int
    dp_group: object
    tp_group: object


def init_mesh_2d(dp_size, tp_size):
    """Create the TP and DP groups of a dp_size x tp_size grid over the whole world.

    Every rank must call this, with the same arguments: `new_group` is collective, each rank
    creates every group in the same order and keeps the two it belongs to. (With DeviceMesh
    the same grid is `init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))`.)
    """
    world = dist.get_world_size()
    for name, value in (("dp_size", dp_size), ("tp_size", tp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if dp_size * tp_size != world:
        raise ValueError(f"dp_size={dp_size} x tp_size={tp_size} = {dp_size * tp_size} ranks, "
                         f"but the world has {world}")
    rank = dist.get_rank()
    tp_group = dp_group = None
    for d in range(dp_size):
        ranks = [d * tp_size + t for t in range(tp_size)]
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for t in range(tp_size):
        ranks = [d * tp_size + t for d in range(dp_size)]
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return Mesh2D(dp_size, tp_size, rank // tp_size, rank % tp_size, dp_group, tp_group)


def destroy_mesh_2d(mesh):
    """Release the two groups (every rank calls it; only needed when the world lives on)."""
    for group in (mesh.tp_group, mesh.dp_group):
        dist.destroy_process_group(group)


def split_batch(x, dp_group):
    """Global batch `[B, ...]` -> this DP rank's rows `[B/dp, ...]` (the same on its TP peers)."""
    dp = group_size(dp_group)
    if x.shape[0] % dp:
        raise ValueError(f"global batch size {x.shape[0]} is not divisible by the "
                         f"data-parallel size {dp}")
    return x.chunk(dp, dim=0)[group_rank(dp_group)]


def data_parallel_loss(model, input_ids, labels, dp_group, *, ignore_index=-100, **kwargs):
    """This DP rank's loss, scaled so that averaging over DP gives the whole batch's mean.

    The whole batch's loss is (sum of token losses) / (tokens counted), over all DP ranks.
    Averaging per-rank *means* gets that only when every rank counts the same number of
    tokens; ignore_index labels (or padding) can break that. So each rank returns
        its sum of token losses / (tokens counted on all DP ranks / dp)
    which is its plain mean when the counts are equal, and exact when they are not. The
    mean of these over DP is the whole batch's loss, the mean of their gradients its gradient:
    call `average_gradients` after backward. Costs one tiny all-reduce of the token count.
    """
    loss_sum = model.loss(input_ids, labels, ignore_index=ignore_index, reduction="sum",
                          **kwargs)  # checks its arguments first, before any collective
    counted = (labels != ignore_index).sum().to(torch.float64)
    all_reduce_(counted, dp_group)  # same labels on TP peers, so the count is too
    return loss_sum / (counted / group_size(dp_group)).to(loss_sum.dtype)


@torch.no_grad()
def average_gradients(model, dp_group):
    """Average every gradient over the DP group: sharded and replicated parameters alike,
    since rank (d, t) holds the same shard as rank (d', t). One all-reduce per dtype."""
    grads = {}
    for param in model.parameters():
        if param.grad is not None:
            grads.setdefault(param.grad.dtype, []).append(param.grad)
    for same_dtype in grads.values():
        average_over_group_(same_dtype, dp_group)
