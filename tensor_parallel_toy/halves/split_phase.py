"""The sequence all-gather and reduce-scatter in two phases: a node that posts, a node that waits.

The reading path's transitions (comm.py, parallel_linear.py) call each collective whole: the
host posts it and waits for it in one breath, so nothing runs beside it. Here each transition is
two autograd Functions sharing one `Posted` handle:

    posted = post_all_gather_seq(x_local, group)   # _PostAllGather: starts the transfer
    ...                                              # any work that does not need its result
    x_full = posted.wait()                           # _WaitAllGather: waits, returns it

    x_local [s/p, ...] -> x_full [s, ...]    (post_reduce_scatter_seq: [s, ...] partial sums
                                              -> [s/p, ...], rows r*s/p:(r+1)*s/p summed)

and each backward is the forward's conjugate, split the same way, in mirror order. The wait
node's backward *posts* the conjugate (a reduce-scatter for the gather, an all-gather for the
scatter) and hands its input on; the post node's backward *waits* for it and returns the
result. Autograd runs the nodes of independent chains in the reverse order of their creation
(checked on CPU, torch 2.13: the engine takes, among the nodes that are ready, the one created
last), so whatever ran between the post and the wait in the forward runs, backwards, between
the backward's post and its wait: the forward's overlap schedule, mirrored, for free.

    forward:   post(A)  compute(B)  wait(A)
    backward:  post(A') compute(B)' wait(A')      (A' = A's conjugate, in the order autograd
                                                   runs them: wait(A).backward first)

The tensor that passes from the post node to the wait node is the transfer's output buffer,
not yet filled: only the wait node's output may be read. Buffers stay referenced by the
handle and by autograd until their wait, so they cannot be freed under a running transfer
(on NCCL the process group also keeps them for its stream; read, not run).
"""
import torch

from ..comm import all_gather_seq, reduce_scatter_seq


class Posted:
    """A transfer in flight between its post node and its wait node (forward), and the
    conjugate in flight between the wait node's backward and the post node's (backward)."""

    def __init__(self, kind, group):
        self.kind, self.group = kind, group
        self.output = self.work = None  # the forward's transfer: its buffer and handle
        self.grad = None  # the backward's: (input kept alive, output buffer, handle)
        self.tensor = None  # the post node's output, the wait node's input

    def wait(self):
        """Wait for the transfer (the wait node): its result, through autograd."""
        if self.tensor is None:
            raise RuntimeError(f"{self.kind}: waited for twice; a Posted is waited for once")
        tensor, self.tensor = self.tensor, None
        return _Wait.apply(tensor, self)


def _start(kind, x, group):
    """Post `kind` ("all-gather" or "reduce-scatter" along dim 0); (output buffer, work)."""
    collective = all_gather_seq if kind == "all-gather" else reduce_scatter_seq
    return collective(x.contiguous(), group, async_op=True)


CONJUGATE = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather"}


class _Post(torch.autograd.Function):
    """forward: post the transfer, return its (unfilled) output buffer; backward: wait for the
    conjugate the wait node's backward posted, return its result."""

    @staticmethod
    def forward(ctx, x, posted):
        posted.output, posted.work = _start(posted.kind, x, posted.group)
        ctx.posted = posted
        # A group of one rank returns x itself, which a Function must hand on as a view.
        return x.view_as(x) if posted.output is x else posted.output

    @staticmethod
    def backward(ctx, _grad_passed_on):
        _input_kept_alive, output, work = ctx.posted.grad
        if work is not None:
            work.wait()
        ctx.posted.grad = None  # the conjugate's input may go now
        return output, None


class _Wait(torch.autograd.Function):
    """forward: wait for the transfer, return its output; backward: post the conjugate of the
    incoming gradient, pass the gradient on (the post node's backward waits for it)."""

    @staticmethod
    def forward(ctx, buffer, posted):
        if posted.work is not None:
            posted.work.wait()
        posted.work = None
        ctx.posted = posted
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad):
        posted = ctx.posted
        grad = grad.contiguous()
        output, work = _start(CONJUGATE[posted.kind], grad, posted.group)
        posted.grad = (grad, output, work)
        return grad, None


def _post(kind, x, group):
    posted = Posted(kind, group)
    posted.tensor = _Post.apply(x, posted)
    return posted


def post_all_gather_seq(x_local, group):
    """Post sequence parallelism's gather: `[s/p, ...]` -> `[s, ...]` at `.wait()`
    (backward: a reduce-scatter, posted and waited for in mirror order)."""
    return _post("all-gather", x_local, group)


def post_reduce_scatter_seq(x_full, group):
    """Post sequence parallelism's scatter: `[s, ...]` partial sums -> `[s/p, ...]`, this rank's
    rows summed over the group, at `.wait()` (backward: an all-gather, likewise)."""
    return _post("reduce-scatter", x_full, group)
