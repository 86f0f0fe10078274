"""Communication along the tensor-parallel group: collectives, region transitions, the P2P ring.

Activations are sequence-first, `[s, b, h]`. Under sequence parallelism TP rank r holds rows
`r*s/p:(r+1)*s/p` of the sequence, so "gather the sequence" is an all-gather along dim 0 and
"scatter the sequence" a reduce-scatter along dim 0: for a contiguous tensor both are plain
concatenations of equal flat blocks, which is what `all_gather_single` and
`reduce_scatter_single` move.

Every function takes its group explicitly; a group of one rank returns early, so the same code
runs at TP size 1.
"""
import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


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
    work = dist.all_gather_single(out, x_local, group=group, async_op=async_op)
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
    work = dist.reduce_scatter_single(out, x_full, group=group, async_op=async_op)
    return out, work


def all_reduce_(x, group):
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather_dim(x, dim, group):
    """Concatenate every rank's `x` along `dim` (used for whole tensors: weights, grads, logits)."""
    p = group_size(group)
    if p == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x.contiguous(), group=group)
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
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= p
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return tensors


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

    Partial results (a classic row-parallel layer's output, one term per rank) become their
    sum on every rank; the sum's gradient with respect to each term is the incoming gradient.
    """

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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


# ----------------------------------------------------------------------------------------------
# Replicated parameters under sequence parallelism
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
        if getattr(param, "sequence_parallel", False) and not getattr(param, "_sp_hooked", False):
            param.register_hook(lambda grad: all_reduce_(grad.clone(), group))
            param._sp_hooked = True
            hooked += 1
    return hooked


# ----------------------------------------------------------------------------------------------
# The P2P ring used by the overlapped layers
# ----------------------------------------------------------------------------------------------
_COMM_STREAMS = {}  # one CUDA side stream per (group, device), created once and reused


def _comm_stream(group, device):
    key = (group, device)
    if key not in _COMM_STREAMS:
        _COMM_STREAMS[key] = torch.cuda.Stream(device=device)
    return _COMM_STREAMS[key]


class _Pending:
    """A posted ring step. `wait()` makes the received chunk safe to read on this rank."""

    def __init__(self, works=None, done_event=None):
        self.works, self.done_event = works, done_event

    def wait(self):
        if self.done_event is not None:
            # GPU: the compute stream waits for the comm stream; the host never blocks.
            torch.cuda.current_stream().wait_event(self.done_event)
        else:
            for work in self.works:
                work.wait()


class Ring:
    """This rank's neighbours in a ring over `group`, and one step of traffic around it.

    P2P calls address *global* ranks, so the group-local neighbours are translated with
    `get_global_rank`; that is what lets the overlap run on any subgroup, not only WORLD.
    """

    def __init__(self, group, device):
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.stream = _comm_stream(group, device) if device.type == "cuda" else None

    def shift(self, send, recv) -> _Pending:
        """Post: send `send` to the next rank, receive into `recv` from the previous one."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        if self.stream is None:
            # CPU/gloo: the transfer progresses on gloo's own thread while we compute.
            return _Pending(works=dist.batch_isend_irecv(ops))
        # GPU: `send` was written on the compute stream; the comm stream must not read it early.
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # on NCCL this orders the comm stream, it does not block the host
            done = torch.cuda.Event()
            done.record(self.stream)
        # Both buffers were allocated on the compute stream and are now used on the comm
        # stream: tell the caching allocator not to hand them out again before it is done.
        send.record_stream(self.stream)
        recv.record_stream(self.stream)
        return _Pending(done_event=done)


def ring_all_gather(x_local, ring, consume):
    """All-gather by passing sequence chunks around the ring; `consume(c, chunk_c)` sees each.

    Step k: rank r holds chunk (r - k) mod p. The send/recv of step k+1's chunk is posted
    *before* consume runs on chunk k, so the transfer is in flight during the GEMM:

        rank r:  post(k=0) | gemm(chunk r)   | wait | post(k=1) | gemm(chunk r-1) | wait | ...
    """
    p, r = ring.size, ring.rank
    spare = [torch.empty_like(x_local) for _ in range(min(p - 1, 2))]
    current = x_local.contiguous()
    for k in range(p):
        pending = None
        if k < p - 1:
            incoming = spare[k % 2]  # not the buffer being sent, nor the one just consumed
            pending = ring.shift(send=current, recv=incoming)
        consume((r - k) % p, current)
        if pending is not None:
            pending.wait()
            current = incoming


def ring_reduce_scatter(partial_chunk, ring):
    """Reduce-scatter where `partial_chunk(c)` computes this rank's partial sum of chunk c.

    The running sum of chunk c starts on rank c+1 and travels right around the ring, each rank
    adding its own partial, until it reaches rank c with all p partials in it. Each rank sends
    p-1 chunks of N/p elements: the same traffic as one reduce-scatter. While one accumulator
    is in flight, the GEMM for the next chunk runs.
    """
    p, r = ring.size, ring.rank
    acc = partial_chunk((r - 1) % p)
    if p == 1:
        return acc
    incoming = [torch.empty_like(acc), torch.empty_like(acc)]
    for k in range(1, p):
        pending = ring.shift(send=acc, recv=incoming[k % 2])
        partial = partial_chunk((r - 1 - k) % p)
        pending.wait()
        acc = partial.add_(incoming[k % 2])
    return acc
