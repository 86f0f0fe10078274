"""The same baseline `Transformer`, parallelized by PyTorch's own DTensor tensor parallelism.

This is what one would write with `torch.distributed.tensor.parallel` instead of the
hand-written layers: a plan that maps module names to parallel styles, applied to the plain
single-device model by `parallelize_module`. Our activations are sequence-first, `[s, b, h]`,
so every sequence shard is `Shard(0)` (PyTorch's examples use `[b, s, h]` and `Shard(1)`).

    embed        RowwiseParallel   vocab rows split; output reduce-scattered to Shard(0)
    *_norm       SequenceParallel  replicated weight applied to this rank's s/p rows
    attn, mlp    PrepareModuleInput  Shard(0) -> Replicate(): all-gather the sequence
    qkv, fc1     ColwiseParallel   output features split: [s, b, 3h/p], [s, b, f/p]
    proj, fc2    RowwiseParallel   input features split; output reduce-scattered to Shard(0)
    head         ColwiseParallel   vocab split, logits stay a DTensor for `loss_parallel`

The fused qkv weight is laid out head by head, so a Colwise row shard holds whole heads and the
attention code's `view(s, b, -1, 3, head_dim)` works on the local shard unchanged.

The sequence-parallel trap. A replicated weight applied to sequence-sharded activations (the
norms) gets a gradient that is only a partial sum over this rank's tokens: DTensor marks it
`Partial()` rather than reducing it. DTensor ops that later read it (the optimizer's) reduce it
implicitly, once per op that reads it, but anything that takes the local tensor (a gradient
norm from local shards, a custom optimizer, a hook, a check) silently sees 1/p of the tokens.
`reduce_partial_grads` puts every gradient into its parameter's own placement once per step
(one all-reduce per norm weight, like the hand-written model's gradient hooks), after which a
replicated gradient is the full gradient on every rank.
"""
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from .comm import all_reduce_


def tp_plan(config):
    """The parallelize plan for `Transformer(config)`, by module name."""
    seq_shard = Shard(0)  # our activations are [s, b, h]
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_shard),
        "norm": SequenceParallel(sequence_dim=0),
        "head": ColwiseParallel(input_layouts=seq_shard, output_layouts=Shard(-1),
                                use_local_output=False),  # DTensor logits for loss_parallel
    }
    grouped = config.num_kv_heads != config.num_heads
    for i in range(config.num_layers):
        block = f"layers.{i}"
        # Grouped-query attention has separate q and kv weights (kv rows laid out k/v head by
        # k/v head): Colwise shards of both hold whole heads, as long as each rank gets at
        # least one k/v head (checked by `check_plan`).
        projections = ({f"{block}.attn.q": ColwiseParallel(), f"{block}.attn.kv": ColwiseParallel()}
                       if grouped else {f"{block}.attn.qkv": ColwiseParallel()})
        plan.update(projections)
        plan.update({
            f"{block}.attn_norm": SequenceParallel(sequence_dim=0),
            # Attention.forward(x, cos, sin): only x is an activation to gather.
            f"{block}.attn": PrepareModuleInput(input_layouts=(seq_shard, None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
            f"{block}.attn.proj": RowwiseParallel(output_layouts=seq_shard),
            f"{block}.mlp_norm": SequenceParallel(sequence_dim=0),
            f"{block}.mlp": PrepareModuleInput(input_layouts=(seq_shard,),
                                               desired_input_layouts=(Replicate(),)),
            f"{block}.mlp.fc1": ColwiseParallel(),
            f"{block}.mlp.fc2": RowwiseParallel(output_layouts=seq_shard),
        })
    return plan


def check_plan(config, tp_size):
    """What this plan cannot express, refused in one line before any collective."""
    if config.tie_embeddings:
        raise ValueError("tie_embeddings=True: parallelize_module gives the embedding and the "
                         "head each a new DTensor parameter, silently untying them; untie them "
                         "or leave the dtensor mode out")
    if config.mlp != "gelu":
        raise ValueError(f"mlp={config.mlp!r}: this plan names the GELU MLP's fc1/fc2; for a "
                         f"Llama-style model use parallelize_hf_model on the Hugging Face model")
    if config.num_kv_heads < tp_size:
        raise ValueError(f"num_kv_heads={config.num_kv_heads} < TP size {tp_size}: the dtensor "
                         f"plan cannot replicate k/v heads; use at least {tp_size} k/v heads or "
                         f"leave the dtensor mode out")


def parallelize(model, tp_group, device_type="cpu"):
    """Shard a baseline `Transformer` (built with tp_group=None) in place over `tp_group`.

    Every rank must pass the same full model (e.g. `Transformer(config, seed=s)`): each keeps
    its own shard of every split weight, so the result starts from the baseline's weights.
    """
    check_plan(model.config, tp_group.size())
    mesh = DeviceMesh.from_group(tp_group, device_type)
    return parallelize_module(model, mesh, tp_plan(model.config))


def loss(model, input_ids, labels):
    """Mean cross-entropy on vocab-sharded logits: `loss_parallel` computes the softmax
    without gathering `[b, s, V]`. Backward must run inside the same context, so call
    `.backward()` on the result within `loss_parallel()` too (see `loss_and_backward`)."""
    logits = model(input_ids)  # DTensor [b, s, V], Shard(2)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def loss_and_backward(model, input_ids, labels):
    """One forward + backward; returns the (replicated) loss as a plain scalar tensor."""
    with loss_parallel():
        value = loss(model, input_ids, labels)
        value.backward()
    return value.to_local().detach()


@torch.no_grad()
def reduce_partial_grads(model):
    """Give each gradient its parameter's placement: `Partial()` -> `Replicate()` is the
    all-reduce of the sequence-parallel partial sums; a `Replicate()` gradient of a sharded
    parameter (the embedding's) is cut down to this rank's shard. Returns how many changed."""
    changed = 0
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)
            changed += 1
    return changed


@torch.no_grad()
def grad_norm(model, tp_group):
    """Global L2 norm of the gradients, from local shards, read from the DTensor placements:
    a `Shard` gradient's local squares are summed over the group, a `Replicate` one is counted
    once. A `Partial` gradient has no meaningful local norm: reduce it first."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        sq = local.double().pow(2).sum().cpu()
        placements = grad.placements if isinstance(grad, DTensor) else (Replicate(),)
        if any(isinstance(p, Partial) for p in placements):
            raise ValueError(f"{name}: gradient is Partial (an unreduced sequence-parallel "
                             f"partial sum); call reduce_partial_grads(model) first")
        if any(isinstance(p, Shard) for p in placements):
            sharded += sq
        else:
            replicated += sq
    device = next(model.parameters()).device
    sharded = all_reduce_(sharded.to(device), tp_group)
    return (sharded.cpu() + replicated).sqrt().item()
