"""2D parallelism: data parallel (DP) across copies of a tensor-parallel (TP) model.

The world is a dp x tp grid of ranks; global rank = dp_index * tp + tp_index:

                 tp_index 0   tp_index 1
    dp_index 0:    rank 0       rank 1      <- a TP group: one model, split in two
    dp_index 1:    rank 2       rank 3      <- another TP group: a second copy of it
                     ^            ^
                 DP groups: the same shard of the model in each copy

TP groups are runs of consecutive ranks, so under torchrun they stay inside one machine, where
the links are fastest; DP traffic (gradient reduction) crosses machines. `init_mesh_2d` builds
this grid as a DeviceMesh with dimensions ("dp", "tp").

The data-parallel part is PyTorch's own, applied over the "dp" dimension:
- `apply_fsdp`: FSDP2 (`fully_shard`), each block and then the root. Every rank stores 1/dp of
  its TP shard of the parameters, gradients and optimizer state; the block's parameters are
  all-gathered before its forward and backward, its gradients reduce-scattered after.
- `apply_ddp`: DDP. Every rank keeps its whole TP shard; gradients are all-reduced in buckets
  while backward runs.
Both average the gradients over the DP group during backward. Both hook the wrapped module's
`forward`, which is why the model computes its loss there: `model(ids, labels)`.

One training step:
1. every rank of a TP group gets the same DP slice of the global batch (`split_batch`);
2. forward and backward inside the TP group, as for a single TP model, the engine averaging
   the gradients over the DP group as they are produced;
3. the optimizer step on this rank's parameters (FSDP: its shard of them).
With `data_parallel_loss` the result is exactly the loss and gradients of the whole batch on
one device, even when the DP ranks count different numbers of tokens.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..comm import all_reduce_, group_rank, group_size
from ..model import Transformer


def init_mesh_2d(dp_size, tp_size, device_type="cpu"):
    """The dp_size x tp_size grid over the whole world, a DeviceMesh with dimensions
    ("dp", "tp"): `mesh["tp"].get_group()` is this rank's TP group, `mesh["dp"]` its DP mesh.

    Every rank must call this, with the same arguments (creating the groups is collective);
    the sizes are checked first, so a bad one is one ValueError on every rank.
    """
    for name, value in (("dp_size", dp_size), ("tp_size", tp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    world = dist.get_world_size()
    if dp_size * tp_size != world:
        raise ValueError(f"dp_size={dp_size} x tp_size={tp_size} = {dp_size * tp_size} ranks, "
                         f"but the world has {world}")
    return init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))


def apply_fsdp(model, mesh, *, mp_policy=None, reshard_after_forward=True):
    """FSDP2 over `mesh["dp"]` on a `Transformer`, ours (tp_group=mesh["tp"].get_group()) or
    the DTensor plan's (`dtensor_tp.parallelize_transformer(model, mesh["tp"])`). Returns `model`.

    Each block is its own unit, so only one block's full parameters exist at a time and its
    all-gather can overlap the previous block's compute; the root unit holds the rest
    (embedding, final norm, head). A parameter is split along its dim 0 over the DP ranks: for
    ours a plain tensor (this TP rank's shard) becomes a DTensor on the DP mesh; for the DTensor
    plan a DTensor on the TP mesh becomes one on the 2-D mesh. `mp_policy`, e.g.
    `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`: compute in
    bf16, keep fp32 parameters and reduce the gradients in fp32.
    """
    if getattr(type(model), "sharded_logits", Transformer.sharded_logits) \
            is not Transformer.sharded_logits:
        # FSDP2 gathers a block's weights in hooks around the block's forward; a model that
        # runs its blocks' layers without calling it (halves/) would compute on the shards.
        raise ValueError(f"apply_fsdp({type(model).__name__}): it runs its blocks without "
                         f"calling their forward, where FSDP2 gathers their weights; use "
                         f"Transformer")
    kwargs = dict(mesh=mesh["dp"], reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model, mesh):
    """DDP over `mesh["dp"]` on our `Transformer` (tp_group=mesh["tp"].get_group()).

    Call the wrapper (`ddp(ids, labels)`), never `ddp.module`'s methods for the step: DDP
    reduces the gradients only of a backward that followed its own `forward`. The full state
    dict and gradients are `full_state_dict(ddp.module)` / `full_grads(ddp.module)`. The model's
    buffers are fixed tables (rotary angles), the same on every rank: no need to broadcast
    them before every forward.
    """
    return DistributedDataParallel(model, device_mesh=mesh["dp"], forward_sync_buffers=False)


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
    mean of these over DP is the whole batch's loss, the mean of their gradients its gradient,
    which is what FSDP and DDP compute. `model` is the wrapped model (its forward is called).
    Costs one tiny all-reduce of the token count.
    """
    loss_sum = model(input_ids, labels, ignore_index=ignore_index, reduction="sum",
                     **kwargs)  # checks its arguments first, before any collective
    counted = (labels != ignore_index).sum().to(torch.float64)
    all_reduce_(counted, dp_group)  # same labels on TP peers, so the count is too
    return loss_sum / (counted / group_size(dp_group)).to(loss_sum.dtype)
