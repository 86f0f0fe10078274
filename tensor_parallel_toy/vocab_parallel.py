"""The vocabulary split over the TP ranks: embedding lookup and cross-entropy, neither ever full.

Notation: p = TP size, r = this rank's index in `tp_group`, V = vocabulary size, s = sequence,
b = batch. Rank r owns vocabulary rows `r*V/p:(r+1)*V/p` (its "shard") of

- the embedding table `[V/p, h]`: `VocabParallelEmbedding`, and
- the LM head `[V/p, h]` (a ColumnParallelLinear), whose logits `[s, b, V/p]` go straight into
  `vocab_parallel_cross_entropy`, so the `[s, b, V]` logits, the biggest activation of a small
  model, never exist on any rank.

With `tie_embeddings` both are one weight; the shards line up because both split the same rows.

A vocabulary p does not divide (32001, 50257) is padded, as Megatron pads it, to V' rows, the
next multiple of p (`config.padded_vocab_size`), and V/p above reads V'/p: the last ranks' last
rows are padding. They are zeros, no valid id looks them up, the loss masks their logits out
of its max, its softmax and its gradient (exactly 0), the gathered logits drop them, and the
full tensors (`support.sharding`) leave them out: no checkpoint holds them.

An id outside the vocabulary would be masked on every rank and silently become a zero
embedding or a wrong loss. Nothing here checks: `guard(model)` (guards/) checks a model's ids
and labels before any collective; called directly, the layer and the loss assume them in
range.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .comm import (all_reduce_, group_rank, group_size, reduce_from_tensor_parallel_region,
                   reduce_scatter_to_sequence_parallel_region)
from .config import padded_vocab_size
from .parallel_linear import init_from_full_, layout_of, set_layout


def vocab_range(vocab_size, group):
    """[start, end) of the real vocabulary rows this rank owns: its block of the padded
    vocabulary, less the padding past vocab_size (end = start on a rank holding only that)."""
    shard = padded_vocab_size(vocab_size, group_size(group)) // group_size(group)
    start = group_rank(group) * shard
    return start, max(start, min(start + shard, vocab_size))


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the TP ranks.

    input_ids `[s, b]`, the same on every rank  ->  `[s/p, b, h]`, this rank's sequence rows
    (`sequence_parallel=False`: ids `[...]` -> `[..., h]`, the whole lookup on every rank).
    Weight shard `[V/p, h]` = rows r*V/p:(r+1)*V/p of the full table (its layout: dim 0),
    the vocabulary padded to a multiple of p (zero rows, never looked up: see the module).

    Each rank looks up every token in its own shard; a token outside it gets zeros. Exactly one
    rank finds each token, so the sum over ranks is the full lookup: a reduce-scatter along the
    sequence both forms that sum and leaves each rank its s/p rows of it, in one collective
    (backward: all-gather, its conjugate); without SP, `g`'s all-reduce forms it on every rank
    (backward: identity). The weight's gradient needs no reduction: every rank gets the
    gradient of all tokens, and the lookup's backward keeps those of its own vocabulary rows.

    `init_weights`: draw the full table as nn.Embedding does and keep this rank's rows (a
    model that draws all its weights at once passes False).
    """

    def __init__(self, num_embeddings, embedding_dim, *, tp_group, sequence_parallel=True,
                 device=None, dtype=None, init_weights=True):
        super().__init__()
        p = group_size(tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, tp_group)
        self.weight = nn.Parameter(
            torch.empty(padded_vocab_size(num_embeddings, p) // p, embedding_dim, device=device,
                        dtype=dtype))
        set_layout(self, "weight", dim=0, full_size=num_embeddings)
        if init_weights:  # nn.Embedding's default, N(0, 1)
            init_from_full_(self.weight, layout_of(self, "weight"), nn.init.normal_, tp_group)

    def lookup(self, input_ids):
        """ids `[...]` -> `[..., h]`: each id's row if this rank holds it, zeros otherwise (the
        sum over the ranks is the whole lookup; halves/ sums it itself)."""
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)  # any valid row
        x = F.embedding(local_ids, self.weight)  # [..., h]
        return x.masked_fill(outside.unsqueeze(-1), 0.0)  # not ours: another rank adds it

    def forward(self, input_ids):
        x = self.lookup(input_ids)  # [s, b, h], a partial sum over the ranks
        if not self.sequence_parallel:
            return reduce_from_tensor_parallel_region(x, self.tp_group)  # [..., h]
        return reduce_scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/p, b, h]

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"vocab rows {self.vocab_start}:{self.vocab_end}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocab-sharded logits; three small all-reduces, never the
    full logits.

    logits_local `[N, V/p]` (this rank's vocabulary columns), labels `[N]` (the same on every
    rank)  ->  loss `[N]` fp32, the same on every rank, 0 where label == ignore_index. Columns
    past `vocab_size` (a padded vocabulary's) are -inf: out of c, S and the loss, gradient 0.

    With z = logits and t = label, for one token:
        c   = max_v z_v                      all-reduce MAX  (only for exp's range; not
                                                              differentiated: the loss is
                                                              shift-invariant)
        S   = sum_v exp(z_v - c)             all-reduce SUM  } stacked into one all-reduce:
        z_t - c                              all-reduce SUM  } only the rank owning t has it,
        sum_v (z_v - c)  (label smoothing)   all-reduce SUM  } the others add 0
        loss = log S - (z_t - c)                                     (eps = 0)
             = (1 - eps) (log S - (z_t - c)) + eps (log S - sum_v (z_v - c) / V)

    backward, with softmax q_v = exp(z_v - c) / S kept from forward (this rank's columns only):
        dz_v = dloss * (q_v - (1 - eps) [v == t] - eps / V)
    which each rank computes for its own columns with no communication at all.
    """

    @staticmethod
    def forward(ctx, logits_local, labels, group, vocab_size, ignore_index, label_smoothing):
        start, end = vocab_range(vocab_size, group)
        real = end - start  # this rank's columns before the padding
        z = logits_local.float()
        if real < z.shape[-1]:  # the padding: never in the max, the softmax or the loss
            z = z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= real, float("-inf"))
        c = all_reduce_(z.max(dim=-1).values, group, op=dist.ReduceOp.MAX)  # [N]
        z = z - c.unsqueeze(-1)  # [N, V/p], all <= 0
        exp = z.exp()

        counted = labels != ignore_index
        mine = counted & (labels >= start) & (labels < end)  # the target column is on this rank
        col = (labels - start).masked_fill(~mine, 0)  # [N], any valid column when not mine
        target = z.gather(-1, col.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = [exp.sum(dim=-1), target]
        if label_smoothing > 0:
            sums.append(z[:, :real].sum(dim=-1))
        sums = all_reduce_(torch.stack(sums), group)  # [2 or 3, N], one collective
        log_s, target = sums[0].log(), sums[1]

        loss = log_s - target
        if label_smoothing > 0:
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_s - sums[2] / vocab_size)
        loss = loss.masked_fill(~counted, 0.0)

        softmax = exp.div_(sums[0].unsqueeze(-1))  # [N, V/p], reuses exp's memory
        ctx.save_for_backward(softmax, col, mine, counted)
        ctx.label_smoothing, ctx.vocab_size, ctx.real = label_smoothing, vocab_size, real
        ctx.dtype = logits_local.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        softmax, col, mine, counted = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax - eps / ctx.vocab_size if eps > 0 else softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, col] -= (1 - eps) * mine.to(grad.dtype)  # the one-hot, on the owning rank
        grad[:, ctx.real:] = 0  # the padding never reached the loss
        grad *= (dloss * counted).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_local, labels, tp_group, *, vocab_size=None,
                                 ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    """`F.cross_entropy(full_logits, labels, ...)` computed from this rank's logit columns.

    logits_local `[..., V/p]` (this rank's vocabulary shard, as from a ColumnParallelLinear
    head), labels `[...]` (class ids, the same on every rank). Returns what F.cross_entropy
    would on the full `[..., V]` logits, in fp32 and the same on every rank: `reduction="mean"`
    averages over the tokens whose label is not ignore_index (nan if there are none, as in
    PyTorch), "sum" adds them, "none" gives the `[...]` per-token losses (0 where ignored).
    `vocab_size`: V when the shards are of a padded vocabulary (a head built with `pad=True`:
    V/p reads padded_vocab_size(V, p)/p), whose padding columns are then left out; None: the
    shards hold exactly V = p * V/p columns.
    """
    vocab_size = vocab_size or logits_local.shape[-1] * group_size(tp_group)
    loss = _VocabParallelCrossEntropy.apply(
        logits_local.reshape(-1, logits_local.shape[-1]), labels.reshape(-1), tp_group,
        vocab_size, ignore_index, float(label_smoothing))  # [N]
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum()
