"""The P2P ring the overlapped layers use: move sequence chunks rank to rank while computing.

A whole all-gather (or reduce-scatter) is one collective the GEMM must wait for. Cut into
p - 1 ring steps, each step's transfer can run while the GEMM of a chunk that is already here
runs: the transfer is posted first, then the GEMM, then the wait.

Notation: p = ring size, r = this rank's index in the group, chunk c = the c-th of p equal
blocks along the sequence (rows c*s/p:(c+1)*s/p), which rank c holds under sequence
parallelism.

On CPU (gloo) a posted transfer progresses on gloo's own thread. On CUDA it runs on a side
stream of its own (one per group and device), ordered against the compute stream with events,
so that NCCL's kernels can run beside the GEMM's.
"""
import torch
import torch.distributed as dist

from .comm import group_rank, group_size, transfer

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

    def shift(self, send, recv):
        """Post: send `send` to the next rank, receive into `recv` from the previous one.
        Returns the pending step: its `wait()` makes `recv` safe to read."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        if self.stream is None:
            # CPU/gloo: the transfer progresses on gloo's own thread while we compute.
            return transfer("ring", send, self._post, ops)
        return transfer("ring", send, self._post_on_stream, ops, send, recv, stream=self.stream)

    @staticmethod
    def _post(ops):
        return _Pending(works=dist.batch_isend_irecv(ops))

    def _post_on_stream(self, ops, send, recv):
        # `send` was written on the compute stream; the comm stream must not read it early.
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


def ring_all_gather(shard, ring, consume):
    """Pass this rank's `shard` around the ring; call `consume(c, chunk_c)` on every chunk.

    shard `[n, ...]` (this rank's chunk r); `consume(c, chunk)` gets each of the p chunks once,
    its own first, and must not keep `chunk` (its buffer receives again during the next
    step). The plain code it is equivalent to, with each transfer hidden under a `consume`
    instead:

        chunks = all_gather(shard)                  # [p, n, ...], chunk c from rank c
        for k in range(p):
            consume((r - k) % p, chunks[(r - k) % p])

    Step k: rank r holds chunk (r - k) mod p. The send/recv of step k+1's chunk is posted
    *before* consume runs on chunk k, so the transfer is in flight during the GEMM:

        rank r:  post(k=0) | gemm(chunk r)   | wait | post(k=1) | gemm(chunk r-1) | wait | ...
    """
    p, r = ring.size, ring.rank
    current = shard.contiguous()  # P2P sends and receives whole, densely packed buffers
    spare = [torch.empty_like(current) for _ in range(min(p - 1, 2))]
    for k in range(p):
        pending = None
        if k < p - 1:
            incoming = spare[k % 2]  # not the buffer being sent, nor the one just consumed
            pending = ring.shift(send=current, recv=incoming)
        consume((r - k) % p, current)
        if pending is not None:
            pending.wait()
            current = incoming


def ring_reduce_scatter(produce, ring):
    """Reduce-scatter of partial sums that `produce(c)` computes chunk by chunk, just in time.

    `produce(c)` returns this rank's partial sum of chunk c, `[n, ...]`, a tensor the ring may
    add into. Returns chunk r summed over all ranks. The plain code it is equivalent to, with
    each transfer hidden under the next `produce` instead:

        partials = torch.cat([produce(c) for c in range(p)])   # [p*n, ...]
        return reduce_scatter(partials)                         # chunk r, summed over ranks

    The running sum of chunk c starts on rank c+1 and travels right around the ring, each rank
    adding its own partial, until it reaches rank c with all p partials in it. Each rank sends
    p-1 chunks of N/p elements: the same traffic as one reduce-scatter. While one accumulator
    is in flight, the GEMM for the next chunk runs.
    """
    p, r = ring.size, ring.rank
    acc = produce((r - 1) % p).contiguous()
    if p == 1:
        return acc
    incoming = [torch.empty_like(acc), torch.empty_like(acc)]
    for k in range(1, p):
        pending = ring.shift(send=acc, recv=incoming[k % 2])
        partial = produce((r - 1 - k) % p)
        pending.wait()
        acc = partial.add_(incoming[k % 2])
    return acc
