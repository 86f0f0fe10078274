"""The backward's collectives in one order on every rank, by the graph, not by the engine.

Every rank must start the backward's collectives in the same order: were rank 0 to start one
half's reduce-scatter while rank 1 starts the other half's, the two would pair, and each rank
would get sums of the wrong rows (silently), or wait forever when the halves differ in size.
In the two halves' backward several collective nodes are often ready at once (one half's
transfers, the other half's, the sums of the weights both halves use), and which of them runs
first is the autograd engine's choice (torch 2.13: the one created last), not the graph's.

A `Chain` makes it the graph's. Every collective node of one forward is created through it,
and its input first passes through a link node whose second input is the output of the
collective node created before it:

    forward:   x1 -> C1 -> ...       x2 -> link -> C2 -> ...       x3 -> link -> C3 -> ...
                      `---------------------^       `---------------------^
    backward:  C3, then C2, then C1 (C: a collective node)

A node's backward runs only after the backward of every node that used its output; C(k) used
its link's output, and the link C(k-1)'s: so the graph has one path through all the collective
nodes, and the backward runs them in the reverse order of their creation, on every rank,
whichever node the engine would rather run. Each new edge points from a node to one created
before it, as every edge of the graph does: the graph stays acyclic, nothing waits on itself.
The link hands on x's gradient and gives C(k-1) none (None, not a tensor of zeros: nothing is
allocated, C(k-1)'s gradient is what it was); it changes when C(k-1) may run, nothing else.
"""
import torch


class _Link(torch.autograd.Function):
    """forward: x unchanged (a view); `before` is an input only so that the graph has an edge
    to the node that made it. backward: x's gradient, and none for `before`."""

    @staticmethod
    def forward(ctx, x, before):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Chain:
    """The collective nodes of one forward, each linked after the one created before it."""

    def __init__(self):
        self.last = None  # the output of the collective node created last

    def __call__(self, collective, x, *args):
        """`collective(x, *args)`, whose result comes from one new autograd node with input x
        (a region transition, a post, a wait), that node linked after the last one."""
        # A node whose input already is the last node's output (a wait right after its post)
        # needs no link.
        if self.last is not None and self.last is not x:
            x = _Link.apply(x, self.last)
        self.last = collective(x, *args)
        return self.last
