"""The P2P ring the overlapped layers use: move sequence chunks rank to rank while computing.

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
from .comm import group_rank, group_size, send_recv


class Ring:
    """This rank's neighbours in a ring over `group`, and one step of traffic around it."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def shift(self, send, recv):
        """Post: send `send` to the next rank, receive into `recv` from the previous one.
        Returns the pending step: after its `wait()`, `recv` holds the chunk and `send` may be
        written again."""
        return send_recv(send, self.next, recv, self.prev, self.group)


def ring_all_gather(shard, shard_consumer, ring):
    """Pass this rank's `shard` around the ring; call `shard_consumer(c, chunk_c)` on every chunk.

    shard `[n, ...]` (this rank's chunk r); `shard_consumer(c, chunk)` gets each of the p chunks
    once, its own first, and must not keep `chunk` (its buffer receives again two steps later).
    The plain code it is equivalent to, with each transfer hidden under a consumer call instead:

        chunks = all_gather(shard)                  # [p, n, ...], chunk c from rank c
        for k in range(p):
            shard_consumer((r - k) % p, chunks[(r - k) % p])

    Step k: rank r holds chunk (r - k) mod p. The send/recv of step k+1's chunk is posted
    *before* the consumer runs on chunk k, so the transfer is in flight during the GEMM:

        rank r:  post(k=0) | gemm(chunk r)   | wait | post(k=1) | gemm(chunk r-1) | wait | ...
    """
    p, r = ring.size, ring.rank
    current = shard.contiguous()  # P2P sends and receives whole, densely packed buffers
    spare = [current.new_empty(current.shape) for _ in range(min(p - 1, 2))]
    for k in range(p):
        pending = None
        if k < p - 1:
            # Not `current` (sent and consumed during this step), and never the caller's shard.
            # The other spare held the chunk of step k-1: consumed and sent, both waited for.
            incoming = spare[k % 2]
            pending = ring.shift(send=current, recv=incoming)
        shard_consumer((r - k) % p, current)
        if pending is not None:
            pending.wait()
            current = incoming


def ring_reduce_scatter(chunk_producer, ring):
    """Reduce-scatter of partial sums that `chunk_producer(c)` computes chunk by chunk, just in
    time.

    `chunk_producer(c)` returns this rank's partial sum of chunk c, `[n, ...]`, a tensor the
    ring may add into. Returns chunk r summed over all ranks. The plain code it is equivalent
    to, with each transfer hidden under the next producer call instead:

        partials = torch.cat([chunk_producer(c) for c in range(p)])   # [p*n, ...]
        return reduce_scatter(partials)                         # chunk r, summed over ranks

    The running sum of chunk c starts on rank c+1 and travels right around the ring, each rank
    adding its own partial, until it reaches rank c with all p partials in it. Each rank sends
    p-1 chunks of N/p elements: the same traffic as one reduce-scatter. While one accumulator
    is in flight, the GEMM for the next chunk runs.
    """
    p, r = ring.size, ring.rank
    acc = chunk_producer((r - 1) % p).contiguous()
    if p == 1:
        return acc
    # One receive buffer is enough: the add that reads it is queued before the next step's
    # receive is posted, and the post orders the transfer after it.
    incoming = acc.new_empty(acc.shape)
    for k in range(1, p):
        pending = ring.shift(send=acc, recv=incoming)
        partial = chunk_producer((r - 1 - k) % p)
        pending.wait()
        acc = partial.add_(incoming)
    return acc
