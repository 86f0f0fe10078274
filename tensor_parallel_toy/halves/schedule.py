"""Two halves of the batch, interleaved: each half's transfers run under the other half's compute.

Read after the reading path. The rings (ring.py) hide a transfer only under the GEMMs of its
own layer; attention, the norms, the loss have nothing beside them, which caps what per-layer
overlap can give (the profile prints that ceiling). Splitting the batch makes two independent
computations: while one half's activations cross the wire, the other half can compute anything
at all, attention and norms included (the idea of Domino: Wang et al., 2024, arXiv:2409.15241,
which does it on a second CUDA stream; here the host posts, computes and waits).

Each half runs the model's own layers as a generator (`_half`): where the reading path calls a
collective whole, it posts the split-phase collective (split_phase.py), yields, and waits for
it when resumed; it also yields once inside attention (after the qkv GEMM) and once inside the
MLP (after fc1), so that the turns are of similar length. `interleave` resumes the two halves
in turn, the second one turn behind the first, so that every transfer of one half is on the
wire while the other half computes. (Plain alternation, A, B, A, B, would put each of B's
turns beside a transfer A has not posted yet: A posts at the end of its turn, and waits for it
at the start of its next one, with only B's same turn between.) One block, forward (A, B the halves; AG, RS the sequence
all-gather and reduce-scatter; one line per turn, what is on the wire meanwhile on the right):

    A: norm, post AG(A)
    A: wait AG, qkv GEMM                    AG(A): exposed, the pipeline's fill
    B: norm, post AG(B)
    A: attend, proj GEMM, post RS(A)        AG(B)
    B: wait AG, qkv GEMM                    RS(A)
    A: wait RS, add, norm, post AG(A)
    B: attend, proj GEMM, post RS(B)        AG(A)
    A: wait AG, fc1 GEMM, gelu              RS(B)
    B: wait RS, add, norm, post AG(B)
    A: fc2 GEMM, post RS(A)                 AG(B)
    B: wait AG, fc1 GEMM, gelu              RS(A)   ... and so on into the next block

The backward needs no schedule of its own. What rests on what:
- Correctness (every rank posts the backward's collectives in one order): by construction.
  Every collective node of one forward, both halves' posts and waits and each `f` that sums a
  weight's gradient, is created through one `Chain` (chain.py), so the backward can run them
  only in the reverse order of their creation. The weights' `f` are not per half:
  `weights_through_f` puts each through its `f` once for both halves, before them.
- The overlap: autograd runs, among the nodes ready at once, the one created last (torch 2.13,
  checked on CPU by the order test), so each backward transfer (posted by a wait node's
  backward) runs under the backward of the compute that hid its forward, before the post
  node's backward waits for it: the forward's schedule, mirrored. Another engine's choice
  would change how much is hidden, not the gradients (but for the order of fp32 additions).

Exact: the halves are the rows of one batch, every op is the path's, so the logits, the loss and
every gradient equal `Transformer`'s up to the order of fp32 additions. The column layers save
their gathered input `[s, b, in]` for the weight's gradient instead of re-gathering it from the
shard in the backward (as parallel_linear's `_AllGatherGemm` does): p times that activation's
memory, one transfer fewer per column layer's backward.

A batch of b rows runs as halves of ceil(b/2) and floor(b/2) rows (an odd batch splits
unevenly); a batch of one row cannot be split into independent halves (the sequence could not:
its second half attends to the first) and is refused. `overlap=True` is refused too: the
halves call the layers' weights, not their forward, so the rings would never run.
"""
from functools import partial

import torch

from ..comm import copy_to_row_holders, copy_to_tensor_parallel_region, group_size
from ..model import RMSNorm, Transformer, rms_norm
from .chain import Chain
from .split_phase import post_all_gather_seq, post_reduce_scatter_seq


def interleave(first, second):
    """Run two generators to their end, in turns: `first` alone once, then `first`, `second`,
    `first`, ... (the second a turn behind, see the module). Returns both results, in order."""
    halves, results = [first, second], [None, None]

    def turn(i):  # False once that half has finished
        try:
            next(halves[i])
            return True
        except StopIteration as done:
            results[i] = done.value
            return False

    live = [0, 1] if turn(0) else [1]
    while live:
        live = [i for i in live if turn(i)]
    return results


def _gather(x, group, chain):
    """`[s/p, b, h]` -> `[s, b, h]`, the other half running meanwhile."""
    posted = post_all_gather_seq(x, group, chain)
    yield
    return posted.wait()


def _scatter(y, group, chain):
    """`[s, b, h]` partial sums -> this rank's rows of their sum `[s/p, b, h]` (the
    Transformer's row layers have no bias), the other half running meanwhile."""
    posted = post_reduce_scatter_seq(y, group, chain)
    yield
    return posted.wait()


def weights_through_f(module, group, chain):
    """Every weight of `module` (the model, or a block) whose gradient the backward sums over
    the ranks, put through its `f` once for both halves, each `f` node linked into `chain`:
    {norm: weight `[h]` or `[hd]`, column layer: (weight, bias)}.

    The norms' weights (the residual stream's and attention's q/k norms) all through one `f`:
    their gradients, both halves' summed, are all-reduced together in one call, at the
    backward's end (the `f` node needs every norm's gradient from both halves first). The rows
    of a column layer that several ranks hold (k/v rows when there are fewer k/v heads than
    ranks), through `f` over their holders, weight and bias, likewise at the end. Through `f`
    per norm and half (as a norm's own forward would), the backward would hold a blocking
    all-reduce per norm and half, each waiting for the other half's transfer still on the
    wire (measured on the modeled 1 Gbit/s wire: 9 of one block's 20 ms of waiting)."""
    norms = [m for m in module.modules() if isinstance(m, RMSNorm)]
    summed = chain(copy_to_tensor_parallel_region, torch.cat([n.weight for n in norms]), group)
    weights = dict(zip(norms, summed.split([n.weight.numel() for n in norms])))
    for layer in module.modules():
        shared = getattr(layer, "shared", None)  # as `ColumnParallelLinear.shard_weights` reads it
        if shared is not None:
            weight = chain(copy_to_row_holders, layer.weight, shared, group)
            bias = None if layer.bias is None else chain(copy_to_row_holders, layer.bias,
                                                         shared, group)
            weights[layer] = (weight, bias)
    return weights


def _norm(norm, x, weights):
    return rms_norm(x, weights[norm], norm.eps)


def _block(block, x, cos, sin, group, weights, chain):
    """`TransformerBlock.forward` on one half `[s/p, b', h]`, yielding at every transfer and
    between the two GEMMs of attention and of the MLP; `weights`: `weights_through_f`."""
    attn, mlp = block.attn, block.mlp
    gathered = yield from _gather(_norm(block.attn_norm, x, weights), group, chain)  # [s, b', h]
    qkv = attn.qkv.gemm(gathered, weights.get(attn.qkv))  # [s, b', qkv rows]
    yield
    heads = attn.attend(qkv, cos, sin, norm=partial(_norm, weights=weights))  # [s, b', nh*hd/p]
    x = x + (yield from _scatter(attn.proj.gemm(heads), group, chain))
    first, second = mlp.layers()
    gathered = yield from _gather(_norm(block.mlp_norm, x, weights), group, chain)
    y = mlp.activate(first.gemm(gathered, weights.get(first)))  # [s, b', m/p]
    yield
    return x + (yield from _scatter(second.gemm(y), group, chain))


def _half(model, ids, weights, chain):
    """`Transformer.sharded_logits` on one half of the batch, ids `[s', b']` -> `[s', b', V/p]`."""
    group = model.tp_group
    cos, sin = model.rotary(ids.shape[0])
    x = yield from _scatter(model.embed.lookup(ids), group, chain)  # [s'/p, b', h]
    for block in model.layers:
        x = yield from _block(block, x, cos, sin, group, weights, chain)
    gathered = yield from _gather(_norm(model.norm, x, weights), group, chain)
    return model.head.gemm(gathered, weights.get(model.head))


def split_batch_in_halves(t, dim=1):
    """The two halves of `t` along its batch dim (ceil and floor of b/2 rows); one row: an
    error naming the batch."""
    b = t.shape[dim]
    if b < 2:
        raise ValueError(f"batch of {b} row(s): two halves of the batch need at least 2 rows; "
                         f"for a single sequence use Transformer(config, tp_group, "
                         f"overlap=True) (the rings) or Transformer's plain layers")
    return t.split([(b + 1) // 2, b // 2], dim=dim)


def block_in_halves(block, x, cos, sin, group):
    """One `TransformerBlock` (built with `tp_group=group`) on x `[s/p, b, h]`, its two halves
    interleaved: the same output as `block(x, cos, sin)`."""
    a, b = split_batch_in_halves(x)
    chain = Chain()
    weights = weights_through_f(block, group, chain)
    return torch.cat(interleave(_block(block, a, cos, sin, group, weights, chain),
                                _block(block, b, cos, sin, group, weights, chain)), dim=1)


class TransformerInHalves(Transformer):
    """`Transformer`, the same weights, calls and results, whose embedding, blocks and head run
    as two interleaved halves of the batch (`model(ids, labels)`, `guard(model)`: as for
    `Transformer`). `tp_group` is required; `overlap=True` is refused (see the module)."""

    def __init__(self, config, tp_group, overlap=False, **kwargs):
        if tp_group is None or overlap:
            raise ValueError(f"TransformerInHalves(tp_group={tp_group}, overlap={overlap}): "
                             f"it needs a TP group, and places the transfers itself "
                             f"(overlap=False: it calls the layers' weights, not their forward)")
        super().__init__(config, tp_group, False, **kwargs)

    def sharded_logits(self, ids):
        if group_size(self.tp_group) == 1:
            return super().sharded_logits(ids)
        a, b = split_batch_in_halves(ids)
        chain = Chain()  # every collective node of this forward, in one line
        weights = weights_through_f(self, self.tp_group, chain)
        return torch.cat(interleave(_half(self, a, weights, chain), _half(self, b, weights, chain)),
                         dim=1)  # [s', b, V/p]
