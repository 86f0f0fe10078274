"""Communication along the tensor-parallel group: collectives and region transitions.

Activations are sequence-first, `[s, b, h]`. Under sequence parallelism TP rank r holds rows
`r*s/p:(r+1)*s/p` of the sequence, so "gather the sequence" is an all-gather along dim 0 and
"scatter the sequence" a reduce-scatter along dim 0: for a contiguous tensor both are plain
concatenations of equal flat blocks, which is what `all_gather_single` and
`reduce_scatter_single` move.

The region transitions are autograd Functions named by the region they lead into, each the
conjugate of another. `f` and `g` are Megatron-LM's tensor-parallel operators (Shoeybi et al.,
2019, arXiv:1909.08053, section 3). Sequence parallelism (Korthikanti et al., 2022,
arXiv:2205.05198) adds a conjugate pair of its own: an all-gather along the sequence on the
way into a tensor-parallel region (backward: reduce-scatter), which the column layer fuses with
its GEMM (parallel_linear.py), and a reduce-scatter on the way out (backward: all-gather),
which the row layer fuses likewise and the vocabulary embedding uses alone (here). The paper
calls them `g` and `g-bar`; the letters are not Megatron's `g`. The P2P ring the overlapped
layers use is in ring.py.

Every function takes its group explicitly; a group of one rank returns early, so the same code
runs at TP size 1. This file is the package's only door to `torch.distributed`'s
communication (the harness's metrics and agreement.py's checks included): every tensor a
collective creates lives on `group_device(group)`, the one device NCCL accepts, and every
transfer goes through `transfer`, the one place a recording (the profile's timeline) can see it.
"""
import contextlib

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def group_device(group=None):
    """Where a tensor must live to travel over `group` (None: the default group): this rank's
    GPU under NCCL (the one `torch.cuda.set_device` chose), else the CPU. A group initialised
    with "nccl" has no CPU backend: a CPU tensor fails there ("No backend type associated with
    device type cpu")."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# The instrumentation seam: every transfer of the package passes through `transfer`
# ----------------------------------------------------------------------------------------------
_recorder = None  # set only inside `recording(...)`; None costs one comparison per transfer


@contextlib.contextmanager
def recording(recorder):
    """Report every transfer (the collectives below, the ring steps of ring.py) to `recorder`.

    `recorder.transfer(kind, nbytes, post)` must call `post()`, which starts the transfer and
    returns its handle (anything with `wait()`), or None when the call blocked until it was
    done, and return a handle with the same `wait()`, or None where `post()` gave None. `kind`
    is "all-gather", "reduce-scatter", "all-reduce", "broadcast" (agreement.py) or "ring".
    Only one recording at a time.
    """
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a recording of the transfers is already active")
    _recorder = recorder
    try:
        yield recorder
    finally:
        _recorder = None


def transfer(kind, tensor, start, *args, **kwargs):
    """`start(*args, **kwargs)`: start a transfer of `tensor`'s bytes and return its handle (or
    None if it blocked); reported to the recording if one is active."""
    if _recorder is None:
        return start(*args, **kwargs)
    return _recorder.transfer(kind, tensor.numel() * tensor.element_size(),
                              lambda: start(*args, **kwargs))


# ----------------------------------------------------------------------------------------------
# Collectives along the sequence dimension (dim 0)
# ----------------------------------------------------------------------------------------------
def all_gather_seq(x_local, group, async_op=False):
    """[s/p, ...] on each rank -> [s, ...] on every rank. Returns (out, work-or-None)."""
    p = group_size(group)
    if p == 1:
        return x_local, None
    x_local = x_local.contiguous()
    out = x_local.new_empty((x_local.shape[0] * p, *x_local.shape[1:]))
    work = transfer("all-gather", x_local, dist.all_gather_single, out, x_local, group=group,
                    async_op=async_op)
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
    work = transfer("reduce-scatter", x_full, dist.reduce_scatter_single, out, x_full,
                    group=group, async_op=async_op)
    return out, work


def all_reduce_(x, group, op=dist.ReduceOp.SUM):
    """Reduce `x` over the group in place (a sum unless `op` says otherwise); returns `x`."""
    if group_size(group) > 1:
        transfer("all-reduce", x, dist.all_reduce, x, op=op, group=group)
    return x


def broadcast_(x, source, group):
    """Overwrite `x` with group rank `source`'s `x`, in place, on every rank; returns `x`."""
    if group_size(group) > 1:
        transfer("broadcast", x, dist.broadcast, x, dist.get_global_rank(group, source),
                 group=group)
    return x


def all_gather_dim(x, dim, group):
    """Concatenate every rank's `x` along `dim` (used for whole tensors: weights, grads, logits)."""
    p = group_size(group)
    if p == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(p)]
    transfer("all-gather", x, dist.all_gather, parts, x, group=group)
    return torch.cat(parts, dim=dim)


def average_over_group_(tensors, group):
    """Replace each tensor by its mean over the group, in place, with one all-reduce.

    The tensors are flattened into one buffer first: one collective of N elements costs far
    less than N/n collectives of n (each has a fixed latency). They must share a dtype.
    """
    tensors = list(tensors)
    p = group_size(group)
    if p == 1 or not tensors:
        return tensors
    flat = all_reduce_(torch.cat([t.reshape(-1) for t in tensors]), group)
    flat /= p
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return tensors


class _Pending:
    """Several posted operations as one handle."""

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
    return transfer("ring", send, lambda: _Pending(dist.batch_isend_irecv(ops)))


# ----------------------------------------------------------------------------------------------
# Small collectives for bookkeeping: numbers, objects, barriers (the harness and agreement.py)
# ----------------------------------------------------------------------------------------------
def reduce_numbers(values, group, op=dist.ReduceOp.SUM):
    """Python numbers in, reduced over the group out (a list of floats): one all-reduce of a
    float64 tensor made on the group's device."""
    t = torch.tensor(list(values), dtype=torch.float64, device=group_device(group))
    return all_reduce_(t, group, op).tolist()


def all_gather_objects(obj, group):
    """[obj of group rank 0, obj of rank 1, ...] on every rank (pickled; for rare, small data).
    torch moves the pickles on the device `torch.cuda.set_device` chose, under NCCL."""
    if group_size(group) == 1:
        return [obj]
    every = [None] * group_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def barrier(group):
    """Every rank of the group gets here before any leaves; on NCCL, on this rank's GPU."""
    device = group_device(group)
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)


# ----------------------------------------------------------------------------------------------
# Region transitions as autograd Functions (each backward is the forward's conjugate)
# ----------------------------------------------------------------------------------------------
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
        p, r = group_size(ctx.group), group_rank(ctx.group)
        return grad.chunk(p, dim=-1)[r].contiguous(), None


def gather_from_tensor_parallel_region(x, group):
    if group_size(group) == 1:
        return x
    return _GatherFromTensorParallelRegion.apply(x, group)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: reduce-scatter along the sequence (dim 0); backward: all-gather along it.

    Korthikanti et al.'s `g-bar` (arXiv:2205.05198): it leaves the tensor-parallel region
    for the sequence-parallel one.

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


class _CopySharedRows(torch.autograd.Function):
    """`f` for rows that only some ranks share: forward identity; backward all-reduce (sum) of
    those rows' gradient over the ranks that hold them.

    x `[n, ...]`: this rank's rows of a split weight, of which rows `first_shared:` are also
    held by the other ranks of its slot, one of `num_slots` groups of p / num_slots ranks
    (attention's k/v rows, when p / nkv ranks share each k/v head). Each of them uses its copy
    for its own query heads only, so each has a partial gradient of it; the copy's true
    gradient is the sum over the slot. Rather than one process group per slot, one all-reduce
    over the whole group of a zero-padded `[num_slots, n - first_shared, ...]` buffer, in which
    each rank fills its own slot: slot j of the sum is the sum over the ranks of slot j.
    The rows before `first_shared` are this rank's alone, and their gradient is left as it is.
    """

    @staticmethod
    def forward(ctx, x, first_shared, slot, num_slots, group):
        ctx.first_shared, ctx.slot, ctx.num_slots, ctx.group = first_shared, slot, num_slots, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        own, shared = grad[:ctx.first_shared], grad[ctx.first_shared:]
        slots = grad.new_zeros((ctx.num_slots, *shared.shape))
        slots[ctx.slot] = shared
        all_reduce_(slots, ctx.group)
        return torch.cat([own, slots[ctx.slot]]), None, None, None, None


def copy_to_tensor_parallel_region(x, group):
    """`f` (see _CopyToTensorParallelRegion)."""
    if group_size(group) == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    """`g` (see _ReduceFromTensorParallelRegion)."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group)


def copy_shared_rows(x, first_shared, slot, num_slots, group):
    """`f` over the rows `first_shared:` of x, among the ranks of `slot` (see _CopySharedRows)."""
    if group_size(group) == 1 or first_shared is None:
        return x
    return _CopySharedRows.apply(x, first_shared, slot, num_slots, group)
