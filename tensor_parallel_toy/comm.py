"""Communication along the tensor-parallel group: the region transitions and their collectives.

Activations are sequence-first, `[s, b, h]`. Under sequence parallelism TP rank r holds rows
`r*s/p:(r+1)*s/p` of the sequence, so "gather the sequence" is an all-gather along dim 0 and
"scatter the sequence" a reduce-scatter along dim 0.

The region transitions come first: autograd Functions named, as in Megatron-LM, by the region
they lead into, each the conjugate of another (the transpose of "copy my block to everyone" is
"sum everyone's copy of my block"). `f` and `g` are Megatron-LM's tensor-parallel operators
(Shoeybi et al., 2019, arXiv:1909.08053, section 3), and in this package the two letters mean
nothing else. Sequence parallelism (Korthikanti et al., 2022, arXiv:2205.05198) adds a pair of
its own: an all-gather along the sequence on the way into a tensor-parallel region (backward:
reduce-scatter), which the column layer fuses with its GEMM (parallel_linear.py), and a
reduce-scatter on the way out (backward: all-gather), which the row layer fuses likewise and
the vocabulary embedding uses alone (here). The P2P ring of the overlapped layers is ring.py.

Every function takes its group explicitly; a group of one rank returns early, so the same code
runs at TP size 1. Every tensor a collective creates is made from its input, so it lives
where the input does: the layers' tensors on this rank's GPU under NCCL, on the CPU under gloo.
"""
import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------------------------
# Region transitions as autograd Functions (each backward is the forward's conjugate)
# ----------------------------------------------------------------------------------------------
class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's `f`: forward identity; backward all-reduce (sum). Conjugate of `g`.

    Shoeybi et al., arXiv:1909.08053, section 3, where `f` opens the MLP and the attention.

    A tensor that is the same on every rank and then used differently on each (the input of a
    classic column-parallel layer, a weight whose rows each rank uses only in part) gets a
    partial gradient on each rank; the true gradient is their sum.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.clone(), ctx.group), None


def copy_to_tensor_parallel_region(x, group):
    """`f` (see _CopyToTensorParallelRegion)."""
    if group_size(group) == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's `g`: forward all-reduce (sum); backward identity. Conjugate of `f`.

    Shoeybi et al., arXiv:1909.08053, section 3, where `g` closes the MLP and the attention.

    Partial results (a classic row-parallel layer's output, one term per rank) become their
    sum on every rank; the sum's gradient with respect to each term is the incoming gradient.
    """

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_from_tensor_parallel_region(x, group):
    """`g` (see _ReduceFromTensorParallelRegion)."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: reduce-scatter along the sequence (dim 0); backward: all-gather along it.

    Sequence parallelism's exit from the tensor-parallel region into the sequence-parallel one
    (Korthikanti et al., arXiv:2205.05198).

    `[s, b, h]` partial sums on every rank -> `[s/p, b, h]`, rows r*s/p:(r+1)*s/p summed over
    the group, on rank r. Used by the vocab-parallel embedding: each rank looks up every token
    but only finds the ones in its vocabulary shard (zeros elsewhere), so the sum over ranks is
    the embedding, and each rank keeps only its sequence rows of it. The backward hands every
    rank the gradient of all `s` rows, because its partial input fed every row's sum.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group)[0], None


def reduce_scatter_to_sequence_parallel_region(x, group):
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """forward: all-gather along the last dim; backward: keep this rank's slice (split).

    Used for the logits that `model(input_ids)` returns: each rank holds `[s, b, V/p]`, the
    caller gets `[s, b, V]` (the loss never does this: see vocab_parallel.py). Whatever every
    rank then computes from the same full logits gives the same incoming gradient everywhere,
    and each rank simply keeps the columns that belong to its shard.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        mine = grad.chunk(group_size(ctx.group), dim=-1)[group_rank(ctx.group)]
        return mine.contiguous(), None


def gather_from_tensor_parallel_region(x, group):
    if group_size(group) == 1:
        return x
    return _GatherFromTensorParallelRegion.apply(x, group)


class _CopyToRowHolders(torch.autograd.Function):
    """`f` for a weight some of whose rows several ranks hold: forward identity; backward each
    such row's gradient summed over the ranks that hold it. The rule the norms follow (a weight
    several ranks use, each for its own part of the work, enters through `f` over them),
    applied row by row: attention's k and v rows, when fewer k/v heads than ranks make the
    ranks of one head share them (model.qkv_rows).

    x `[n, ...]`: this rank's rows; `local` are the ones other ranks hold too, found at `slot`
    in the list of all `num_shared` such rows of the full weight. Rather than a process group
    per set of holders, one all-reduce over the whole group of a zero `[num_shared, ...]`
    buffer in which each rank writes the rows it holds: entry j of the sum is the sum over the
    ranks holding row j, the others adding zeros.
    """

    @staticmethod
    def forward(ctx, x, local, slot, num_shared, group):
        ctx.local, ctx.slot = local, slot  # this rank's shared rows, and where they go
        ctx.num_shared, ctx.group = num_shared, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        local, slot = ctx.local.to(grad.device), ctx.slot.to(grad.device)
        summed = grad.new_zeros((ctx.num_shared, *grad.shape[1:]))
        summed[slot] = grad[local]
        all_reduce_(summed, ctx.group)
        grad = grad.clone()
        grad[local] = summed[slot]
        return grad, None, None, None, None


def copy_to_row_holders(x, shared, group):
    """`f` over the ranks holding each of x's shared rows; `shared` = (local, slot, num_shared)
    as `RowSplit.shared` gives it, or None (see _CopyToRowHolders)."""
    if group_size(group) == 1 or shared is None:
        return x
    return _CopyToRowHolders.apply(x, *shared, group)


# ----------------------------------------------------------------------------------------------
# The collectives they are made of; the ring's one P2P step
# ----------------------------------------------------------------------------------------------
# The one-tensor collectives' names: torch 2.13 calls them *_single and deprecates the older
# names, which are all older torch has (2.11, the CUDA image a GPU machine here runs). Looked up
# at each call, so code that wraps torch.distributed's entry points (the modeled wire) sees them.
ALL_GATHER, REDUCE_SCATTER = (("all_gather_single", "reduce_scatter_single")
                              if hasattr(dist, "all_gather_single") else
                              ("all_gather_into_tensor", "reduce_scatter_tensor"))


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_gather_seq(x_local, group, async_op=False):
    """[s/p, ...] on each rank -> [s, ...] on every rank. Returns (out, work-or-None)."""
    p = group_size(group)
    if p == 1:
        return x_local, None
    x_local = x_local.contiguous()
    out = x_local.new_empty((x_local.shape[0] * p, *x_local.shape[1:]))
    work = getattr(dist, ALL_GATHER)(out, x_local, group=group, async_op=async_op)
    return out, work


def reduce_scatter_seq(x_full, group, async_op=False):
    """[s, ...] partial sums on each rank -> [s/p, ...], chunk r summed over ranks, on rank r."""
    p = group_size(group)
    if p == 1:
        return x_full, None
    if x_full.shape[0] % p:
        raise ValueError(f"cannot reduce-scatter {x_full.shape[0]} sequence rows over {p} ranks")
    x_full = x_full.contiguous()
    out = x_full.new_empty((x_full.shape[0] // p, *x_full.shape[1:]))
    work = getattr(dist, REDUCE_SCATTER)(out, x_full, group=group, async_op=async_op)
    return out, work


def all_reduce_(x, group, op=dist.ReduceOp.SUM):
    """Reduce `x` over the group in place (a sum unless `op` says otherwise); returns `x`."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather_dim(x, dim, group):
    """Concatenate every rank's `x` along `dim` (used for whole tensors: weights, grads, logits)."""
    p = group_size(group)
    if p == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


class Pending:
    """Several posted operations (a batch of P2P works) as one handle: `wait()` waits for all."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()


def send_recv(send, to, recv, source, group):
    """Post, as one batch: send `send` to group rank `to`, receive into `recv` from group rank
    `source`. Returns the pending pair; after its `wait()`, `recv` holds the data and `send` may
    be written again (on NCCL: for work queued on the current stream after the wait)."""
    # P2P calls address global ranks: translated here, the ring runs on any subgroup.
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, to), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, source), group)]
    return Pending(dist.batch_isend_irecv(ops))
