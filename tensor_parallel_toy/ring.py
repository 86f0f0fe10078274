"""The overlap, read after the working model: the P2P ring, which moves sequence chunks rank to
rank while computing, and the column and row layers' overlapped Functions built on it
(`parallel_linear.column_parallel_linear` / `row_parallel_linear` run them for overlap=True;
this file imports nothing of the layers, so the arrow runs one way).

A whole all-gather (or reduce-scatter) is one collective the GEMM must wait for. Cut into
p - 1 ring steps, each step's transfer can run while the GEMM of a chunk that is already here
runs: the transfer is posted first, then the GEMM, then the wait.

Notation: p = ring size, r = this rank's index in the group, chunk c = the c-th of p equal
blocks along the sequence (rows c*s/p:(c+1)*s/p), which rank c holds under sequence
parallelism.

One code path on every backend: post the step from the current stream, compute, then
`wait()`. Where the transfer runs while we compute is the backend's business:
- gloo (CPU): on gloo's own threads; `wait()` blocks the host until the bytes are in.
- NCCL (GPU): on ProcessGroupNCCL's internal CUDA stream, which is the second stream of the
  overlap. Posting makes that stream wait for the work already queued on the current stream
  (so it never reads `send` before the GEMM that wrote it is done); `wait()` makes the
  *current stream* wait for the transfer and returns at once, without blocking the host (see
  https://pytorch.org/docs/stable/distributed.html#synchronous-and-asynchronous-collective-operations
  and ProcessGroupNCCL.cpp's `WorkNCCL::synchronizeStream`). The GEMM queued between post and
  wait therefore runs beside NCCL's kernels; whatever comes after the wait (the next GEMM, the
  reuse of a buffer) is ordered after the transfer by the stream itself.
The functions below hold every buffer of a step until after its wait, so the caching allocator
can hand its memory out again only to work queued after the wait. The ring therefore needs no
stream, event or `record_stream` of its own, and the CPU tests run exactly the code a GPU runs,
except what NCCL does inside. The transfers' priority is set where the
process group is made (initialize.py, `high_priority_streams`), not here.
"""
import functools

import torch
import torch.nn.functional as F

from .comm import all_reduce_, group_rank, group_size, send_recv


class Ring:
    """This rank's neighbours in a ring over `group`, and one transfer around it.

    `pieces` (M): how many transfers each chunk is cut into along its rows (M must divide
    them). With one, a chunk's GEMM waits for the whole chunk; with M, it starts on the first
    of its M pieces while the rest are still on the wire, so at p = 2 an all-gather + GEMM of
    transfer time C and GEMM time G takes about max(G, C + G / (2M)) instead of
    max(C, G/2) + G/2. The functions below call their consumer or producer once per piece,
    with the piece's index among all p * pieces of them (block c * pieces + j is piece j of
    chunk c): `pieces` = 1 is the plain ring.
    """

    def __init__(self, group, pieces=1):
        self.group, self.pieces = group, int(pieces)
        self.size, self.rank = group_size(group), group_rank(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def block_rows(self, chunk_rows):
        """The rows of one piece of a chunk of `chunk_rows` rows (pieces must divide them)."""
        if self.pieces < 1 or chunk_rows % self.pieces:
            raise ValueError(f"{chunk_rows} sequence rows per rank cannot be cut into "
                             f"{self.pieces} ring pieces: give ring_pieces that divide them")
        return chunk_rows // self.pieces

    def shift(self, send, recv):
        """Post: send `send` to the next rank, receive into `recv` from the previous one.
        Returns the pending transfer: after its `wait()`, `recv` holds the data and `send`
        may be written again."""
        return send_recv(send, self.next, recv, self.prev, self.group)


def ring_all_gather(shard, shard_consumer, ring):
    """Pass this rank's `shard` around the ring; call `shard_consumer(i, block_i)` on every
    block.

    shard `[rows, ...]` (this rank's chunk r, M = ring.pieces blocks of rows/M rows);
    `shard_consumer(i, block)` gets each of the p * M blocks once, its own chunk's first, and
    must not keep `block` (its buffer receives again two steps later). The plain code it is
    equivalent to, with each transfer hidden under a consumer call instead:

        blocks = all_gather(shard).chunk(p * M)      # block i: piece i % M of rank i // M's
        for k in range(p):
            for j in range(M):
                i = (r - k) % p * M + j
                shard_consumer(i, blocks[i])

    Step k: rank r holds chunk (r - k) mod p. Each piece of it is passed on to the next rank
    (posted) *before* the consumer runs on it, so the transfers are in flight during the GEMMs:

        rank r:  post(k=0) | gemm(chunk r)   | wait | post(k=1) | gemm(chunk r-1) | wait | ...
    """
    p, r, pieces = ring.size, ring.rank, ring.pieces
    current = shard.contiguous()  # P2P sends and receives whole, densely packed buffers
    spare = [current.new_empty(current.shape) for _ in range(min(p - 1, 2))]
    pending = [None] * pieces  # piece j's transfer posted in the previous step
    for k in range(p):
        # Not `current` (sent and consumed during this step), and never the caller's shard.
        # The other spare held the chunk of step k-1: consumed and sent, both waited for
        # piece by piece below before this step reuses it.
        incoming = spare[k % 2] if k < p - 1 else None
        for j, piece in enumerate(current.chunk(pieces)):
            if pending[j] is not None:
                pending[j].wait()  # piece j of this step's chunk is here
            if incoming is not None:
                pending[j] = ring.shift(send=piece, recv=incoming.chunk(pieces)[j])
            shard_consumer((r - k) % p * pieces + j, piece)
        current = incoming


def ring_reduce_scatter(chunk_producer, ring):
    """Reduce-scatter of partial sums that `chunk_producer(i)` computes block by block, just in
    time.

    `chunk_producer(i)` returns this rank's partial sum of block i, `[rows/M, ...]` (M =
    ring.pieces blocks per chunk; block c * M + j is piece j of chunk c), a tensor the ring
    may add into. Returns chunk r summed over all ranks, `[rows, ...]`. The plain code it is
    equivalent to, with each transfer hidden under the next producer call instead:

        partials = torch.cat([chunk_producer(i) for i in range(p * M)])   # [p*rows, ...]
        return reduce_scatter(partials)                         # chunk r, summed over ranks

    The running sum of chunk c starts on rank c+1 and travels right around the ring, each rank
    adding its own partial, until it reaches rank c with all p partials in it. Each rank sends
    p-1 chunks of N/p elements: the same traffic as one reduce-scatter. While one piece of a
    running sum is in flight, the GEMM for the next piece runs.
    """
    p, r, pieces = ring.size, ring.rank, ring.pieces
    sums, pending, incoming = [None] * pieces, [None] * pieces, [None] * pieces
    for k in range(p):
        c = (r - 1 - k) % p  # the chunk whose running sum passes through this rank now
        for j in range(pieces):
            partial = chunk_producer(c * pieces + j).contiguous()
            if pending[j] is not None:
                pending[j].wait()  # piece j of chunk c's running sum is here
                partial.add_(incoming[j])  # `sums[j]`, now sent, may be dropped
            sums[j] = partial
            if k < p - 1:
                if incoming[j] is None:
                    incoming[j] = partial.new_empty(partial.shape)
                # One receive buffer per piece is enough: the add that reads it is queued
                # before the next receive into it is posted, and the post orders the transfer
                # after it.
                pending[j] = ring.shift(send=partial, recv=incoming[j])
    return sums[0] if pieces == 1 else torch.cat(sums)


# ----------------------------------------------------------------------------------------------
# The column and row layers' overlapped Functions (parallel_linear.py runs them for overlap=True)
# ----------------------------------------------------------------------------------------------
def flat(t):
    """[s, b, n] -> [s*b, n] view (the GEMMs are plain 2-D matmuls)."""
    return t.reshape(-1, t.shape[-1])


def linear_into(out, x, weight, bias):
    """out = x @ weight^T + bias, written into `out` (a slice of a bigger tensor) directly."""
    if bias is None:
        torch.mm(flat(x), weight.t(), out=flat(out))
    else:
        torch.addmm(bias, flat(x), weight.t(), out=flat(out))


class RingAllGatherGemm(torch.autograd.Function):
    """Overlapped all-gather + GEMM: GEMM on chunk k while chunk k+1 travels the ring.

    forward:  ring all-gather of X_r, each arriving chunk c goes straight into
              Y[c*s/p:(c+1)*s/p] = X_c W_r^T (no gathered X is ever materialized).
    backward: 1) ring all-gather of X_r again, dW_r += dY_c^T X_c for each chunk as it arrives;
              2) ring reduce-scatter of dX, computing dX_c = dY_c W_r just before it is sent.
    """

    @staticmethod
    def forward(ctx, x_local, weight, bias, group, pieces):
        ring = Ring(group, pieces)
        rows = ring.block_rows(x_local.shape[0])  # of one block (a piece of a chunk)
        y = x_local.new_empty((x_local.shape[0] * ring.size, *x_local.shape[1:-1],
                               weight.shape[0]))

        def consume(i, x_i):
            linear_into(y[i * rows:(i + 1) * rows], x_i, weight, bias)

        ring_all_gather(x_local, consume, ring)
        ctx.save_for_backward(x_local, weight)
        ctx.group, ctx.pieces = group, pieces
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x_local, weight = ctx.saved_tensors
        ring = Ring(ctx.group, ctx.pieces)
        dy = dy.contiguous()
        rows = ring.block_rows(x_local.shape[0])

        def dy_block(i):
            return dy[i * rows:(i + 1) * rows]

        dw = WeightGradAccumulator(weight)
        ring_all_gather(x_local, lambda i, x_i: dw.add(dy_block(i), x_i), ring)
        dx_local = ring_reduce_scatter(lambda i: dy_block(i).matmul(weight), ring)
        db = flat(dy).sum(dim=0) if ctx.has_bias else None
        return dx_local, dw.result(), db, None, None


class GemmRingReduceScatter(torch.autograd.Function):
    """Overlapped GEMM + reduce-scatter: chunk c's partial GEMM runs while the running sum of
    the previous chunk travels the ring.

    forward:  Y_r = sum over ranks q of X_q[chunk r] W_q^T, via ring_reduce_scatter.
    backward: ring all-gather of dY_r; for each arriving chunk c:
              dX[c] = dY_c W_r (into its slice) and dW_r += dY_c^T X[c].
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, pieces):
        ring = Ring(group, pieces)
        rows = ring.block_rows(x.shape[0] // ring.size)
        y_local = ring_reduce_scatter(lambda i: F.linear(x[i * rows:(i + 1) * rows], weight),
                                      ring)
        if bias is not None:  # replicated: added once, to this rank's rows of the sum
            y_local = y_local + bias
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.pieces = group, pieces
        ctx.has_bias = bias is not None
        return y_local

    @staticmethod
    def backward(ctx, dy_local):
        x, weight = ctx.saved_tensors
        ring = Ring(ctx.group, ctx.pieces)
        rows = ring.block_rows(dy_local.shape[0])
        # Not empty_like(x): x may be a strided view, and `out=` below needs a dense buffer
        # whose row slices are views (a reshape of a strided slice would be a copy).
        dx = x.new_empty(x.shape)
        dw = WeightGradAccumulator(weight)

        def consume(i, dy_i):
            torch.mm(flat(dy_i), weight, out=flat(dx[i * rows:(i + 1) * rows]))
            dw.add(dy_i, x[i * rows:(i + 1) * rows])

        ring_all_gather(dy_local, consume, ring)
        db = None
        if ctx.has_bias:  # each rank's rows' share, summed (see parallel_linear's row layer)
            db = all_reduce_(flat(dy_local).sum(dim=0), ctx.group)
        return dx, dw.result(), db, None, None


# ----------------------------------------------------------------------------------------------
# The weight gradient of a GEMM cut into ring blocks
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def has_fp32_out_gemm(device_type):
    """Whether `torch.mm(a, b, out_dtype=torch.float32)` runs on this device type ("cuda",
    "cpu") for bf16 inputs: on CUDA it does (one tensor-core GEMM, fp32 output), on CPU torch
    2.13 has no such kernel. Asked once per device type, by trying."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (NotImplementedError, RuntimeError, TypeError):
        return False


class WeightGradAccumulator:
    """dW = sum over chunks c of dY_c^T X_c, summed in fp32 whatever the weight's dtype.

    Summing bf16 partial products in bf16 rounds once per chunk; one GEMM over the whole
    sequence (the basic layers) rounds once at the end. Accumulating in fp32 and rounding once
    keeps the overlapped weight gradient as accurate as the basic one (Megatron does the same
    with its fused fp32 gradient accumulation). For bf16 inputs, where the device has a GEMM
    that reads bf16 and writes fp32 (CUDA: `out_dtype`), each chunk is one such GEMM at bf16
    speed, then added; elsewhere (CPU) the chunks are upcast and multiplied in fp32, which is
    slower but the same arithmetic.
    """

    def __init__(self, weight):
        self.dtype = weight.dtype
        self.acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        self.fp32_out = self.dtype != torch.float32 and has_fp32_out_gemm(weight.device.type)

    def add(self, dy_c, x_c):
        dy_c, x_c = flat(dy_c), flat(x_c)
        if self.fp32_out:  # addmm's out_dtype form wants its addend in the inputs' dtype
            self.acc.add_(torch.mm(dy_c.t(), x_c, out_dtype=torch.float32))
        else:  # .float() of an fp32 tensor is the tensor itself
            self.acc.addmm_(dy_c.t().float(), x_c.float())

    def result(self):
        return self.acc.to(self.dtype)
