"""The sequence all-gather and reduce-scatter in two phases: a node that posts, a node that waits.

In the reading path's forward (comm.py, parallel_linear.py) each transition calls its
collective whole: the host posts it and waits for it in one breath, so nothing runs beside it.
Here each transition is two autograd Functions sharing one `Posted` handle:

    posted = post_all_gather_seq(x_local, group)   # _Post: starts the transfer
    ...                                              # any work that does not need its result
    x_full = posted.wait()                           # _Wait: waits, returns it

    x_local [s/p, ...] -> x_full [s, ...]    (post_reduce_scatter_seq: [s, ...] partial sums
                                              -> [s/p, ...], rows r*s/p:(r+1)*s/p summed)

and each backward is the forward's conjugate, split the same way, in mirror order. The wait
node's backward *posts* the conjugate (a reduce-scatter for the gather, an all-gather for the
scatter); the post node's backward *waits* for it and returns the result.

    forward:   post(A)  compute(B)  wait(A)
    backward:  post(A') compute(B)' wait(A')      (A' = A's conjugate, in the order autograd
                                                   runs them: wait(A).backward first)

What rests on what. Correctness: every rank must post the backward's collectives in the same
order. The edge from the post node to the wait node orders one transfer's two nodes; the
order of one transfer against the others (the other half's, the weights' sums) is given by
`chain` (chain.py): every post and wait of one forward (two halves, a model) created through
one `Chain` runs, backward, in the reverse order of its creation, on every rank. Without a
chain (a lone transfer) nothing orders it against other collectives. The overlap: that the
compute between a post and its wait in the forward runs, backwards, between the backward's
post and its wait (the forward's schedule, mirrored) rests on the engine's choice among the
compute nodes ready at once: the one created last (checked on CPU, torch 2.13, by the order
test in tests/test_halves.py). An engine that chose otherwise would hide less, and give the
same gradients up to the order of fp32 additions.

The tensor that passes from the post node to the wait node is the transfer's output buffer,
not yet filled: only the wait node's output may be read. The handle keeps the transfer's input
until the wait (the backward's likewise), so nothing frees a buffer under a running transfer;
it keeps nothing after it (on NCCL the process group also holds them for its stream; read, not
run).
"""
import torch

from ..comm import all_gather_seq, reduce_scatter_seq
from .chain import Chain


class Posted:
    """A transfer in flight between its post node and its wait node (forward), and the
    conjugate in flight between the wait node's backward and the post node's (backward)."""

    def __init__(self, kind, group, chain):
        self.kind, self.group = kind, group
        self.chain = chain  # the Chain (chain.py) of its post node, and of its wait node to be
        self.sent = self.work = None  # the forward's transfer: its input, its handle
        self.grad = None  # the backward's: (its input, its output buffer, its handle)
        self.tensor = None  # the post node's output (the buffer), the wait node's input

    def wait(self):
        """Wait for the transfer (the wait node): its result, through autograd."""
        if self.tensor is None:
            raise RuntimeError(f"{self.kind}: waited for twice; a Posted is waited for once")
        tensor, chain = self.tensor, self.chain
        # The nodes' ctx hold this handle: past its wait it holds nothing of the forward's.
        self.tensor = self.chain = None
        # Linked by an input of its own, not through a link node on the buffer: the transfer
        # writes the buffer in place while it runs, which a view made before would not allow.
        before = None if chain.last is tensor else chain.last
        chain.last = _Wait.apply(tensor, self, before)
        return chain.last


def _start(kind, x, group):
    """Post `kind` ("all-gather" or "reduce-scatter" along dim 0): (its input, its output
    buffer, its handle or None)."""
    collective = all_gather_seq if kind == "all-gather" else reduce_scatter_seq
    x = x.contiguous()
    return (x, *collective(x, group, async_op=True))


CONJUGATE = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather"}


class _Post(torch.autograd.Function):
    """forward: post the transfer, return its (unfilled) output buffer; backward: wait for the
    conjugate the wait node's backward posted, return its result."""

    @staticmethod
    def forward(ctx, x, posted):
        posted.sent, output, posted.work = _start(posted.kind, x, posted.group)
        ctx.posted = posted
        # A group of one rank returns x itself, which a Function must hand on as a view.
        return x.view_as(x) if output is x else output

    @staticmethod
    def backward(ctx, _token):
        # _token: what the wait node's backward handed on, only so that this node runs.
        _sent, output, work = ctx.posted.grad
        if work is not None:
            work.wait()
        ctx.posted.grad = None  # the conjugate's input may go now
        return output, None


class _Wait(torch.autograd.Function):
    """forward: wait for the transfer, return its output; backward: post the conjugate of the
    incoming gradient, hand the gradient on (the post node's backward waits for it)."""

    @staticmethod
    def forward(ctx, buffer, posted, before):
        # `before`: the chain's last collective's output, an input only for the graph's edge.
        if posted.work is not None:
            posted.work.wait()
        posted.sent = posted.work = None
        ctx.posted = posted
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad):
        posted = ctx.posted
        posted.grad = _start(CONJUGATE[posted.kind], grad, posted.group)
        return posted.grad[0], None, None  # a token: the post node's one input gradient


def _post(kind, x, group, chain):
    posted = Posted(kind, group, Chain() if chain is None else chain)
    posted.tensor = posted.chain(_Post.apply, x, posted)
    return posted


def post_all_gather_seq(x_local, group, chain=None):
    """Post sequence parallelism's gather: `[s/p, ...]` -> `[s, ...]` at `.wait()`
    (backward: a reduce-scatter, posted and waited for in mirror order); its post and its wait
    nodes linked into `chain` (None: a chain of their own)."""
    return _post("all-gather", x_local, group, chain)


def post_reduce_scatter_seq(x_full, group, chain=None):
    """Post sequence parallelism's scatter: `[s, ...]` partial sums -> `[s/p, ...]`, this rank's
    rows summed over the group, at `.wait()` (backward: an all-gather, likewise)."""
    return _post("reduce-scatter", x_full, group, chain)
