"""The modules and region transitions a plan (plan.py) puts in place, on the user's layout.

Our layers work sequence-first, `[s, b, h]`; a user's model may be batch-first. Each module
here is told which dim of its activations is the sequence (a style's `Shard(d)`), moves it to
the front (a view) on the way in, and back (made contiguous, as nn.Linear's output is) on the
way out. The checks that need the input's shape (the sequence dim exists, p divides the whole
sequence) come first, before any collective.

    PlannedColumn     ColumnParallelLinear: all-gather(seq) + GEMM, or (sequence_parallel off)
                      `f` + GEMM on a whole input; optionally the features gathered after
    PlannedRow        RowParallelLinear: GEMM + reduce-scatter(seq), or GEMM + `g`
    PlannedEmbedding  VocabParallelEmbedding: lookup + reduce-scatter(seq), or lookup + `g`
    PlannedConvColumn / PlannedConvRow   a 1x1 nn.Conv2d, channels on dim 1, as the column or
                      row layer's operation over the channels (classic TP only: the whole
                      input, or output, on every rank)
Each is the kernel's layer with its `sequence_parallel` switch set by the style's layout: the
GEMMs, collectives and lookups are the kernel's, none written here.
    SequenceParallelDropout   one device's mask, this rank's slice of it
    PlannedNormOverSplit      an RMSNorm over features split over the ranks (a column layer's
                      output: OLMo 2's q/k norm over every head), its weight split alike, its
                      sum of squares all-reduced (`sum_over_split_features`, its own conjugate)
The TP region (a split column output until the row layer) draws from this rank's own random
stream (random.py): the column layer enters it, the row layer leaves it.
    gather_sequence / split_sequence   Shard(d) <-> Replicate(), each the other's conjugate
"""
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from ..comm import (all_gather_seq, all_reduce_, gather_from_tensor_parallel_region, group_rank,
                    group_size, reduce_scatter_seq)
from ..parallel_linear import (ColumnParallelLinear, RowParallelLinear, column_parallel_linear,
                               full_shape, layout_of, row_parallel_linear, set_layout)
from ..vocab_parallel import VocabParallelEmbedding


def to_sequence_first(x, dim, p, where, whole=False):
    """x with its sequence dim `dim` moved to the front (a view), after the checks that must
    come before any collective (`whole`: x holds the whole sequence, which p must divide)."""
    if x.dim() <= (dim if dim >= 0 else -dim - 1):
        raise ValueError(f"{where}: input of shape {list(x.shape)} has no dim {dim} for the "
                         f"sequence; say where the sequence is with Shard(d)")
    n = x.shape[dim]
    if whole and n % p:
        raise ValueError(f"{where}: the sequence (dim {dim} of input shape {list(x.shape)}) has "
                         f"{n} positions, which the TP size {p} does not divide; pad it to "
                         f"{n + (-n) % p} (labels ignored) before the call: it is refused, not "
                         f"padded")
    return x.transpose(0, dim)


class PlannedColumn(ColumnParallelLinear):
    """ColumnParallelLinear that reads and writes the user's layout (see ColwiseParallel). With
    its output split, what follows draws from this rank's stream (random.py) until a row layer.
    With its output gathered, out_features need not divide by p (an LM head over any
    vocabulary): the rows are padded to a multiple of p and the gathered padding dropped."""

    random_stream = None  # random.TensorParallelRandom, given by parallelize_module

    def __init__(self, linear, tp_group, overlap, input_dim, gather_output, output_shape,
                 split_dim, where, rows=None):
        super().__init__(linear.in_features, output_shape or linear.out_features,
                         tp_group=tp_group, bias=linear.bias is not None, rows=rows,
                         sequence_parallel=input_dim is not None,
                         overlap=overlap and input_dim is not None,  # the ring needs SP
                         split_dim=split_dim, pad=gather_output, device=linear.weight.device,
                         dtype=linear.weight.dtype, init_weights=False)
        self.input_dim = input_dim
        self.gather_output = gather_output
        self.where = where

    def forward(self, x):
        gathered = None if self.sequence_parallel else for_column_layers(x)
        if gathered is not None:  # a module's gathered input: the GEMM, its `f` shared
            y = self.gemm(gathered)
        elif not self.sequence_parallel:  # the whole input on every rank: classic TP, `f` + GEMM
            y = super().forward(x)
        else:  # [.., s/p, ..] -> [s/p, .., in] -> all-gather + GEMM -> [s, .., out/p] -> back
            x = to_sequence_first(x, self.input_dim, self.tp_size, self.where)
            y = super().forward(x).transpose(0, self.input_dim).contiguous()
        if self.gather_output:  # a padded vocabulary (`pad`): its padding columns dropped
            y = gather_from_tensor_parallel_region(y, self.tp_group)
            return y[..., :self.out_features].contiguous()
        if self.random_stream is not None:  # the TP region: its draws are this rank's own
            self.random_stream.enter(y.device)
        return y


class PlannedRow(RowParallelLinear):
    """RowParallelLinear that reads and writes the user's layout (see RowwiseParallel); the TP
    region ends at its input: back to the random stream every rank shares."""

    random_stream = None

    def __init__(self, linear, tp_group, overlap, output_dim, where):
        super().__init__(linear.in_features, linear.out_features, tp_group=tp_group,
                         bias=linear.bias is not None, sequence_parallel=output_dim is not None,
                         overlap=overlap and output_dim is not None, device=linear.weight.device, dtype=linear.weight.dtype,
                         init_weights=False)
        self.output_dim = output_dim
        self.where = where

    def forward(self, x):
        if self.random_stream is not None:
            self.random_stream.leave()
        if not self.sequence_parallel:  # GEMM + `g`: the whole sum on every rank, bias once
            return super().forward(x)
        x = to_sequence_first(x, self.output_dim, self.tp_size, self.where, whole=True)
        return super().forward(x).transpose(0, self.output_dim).contiguous()


class PlannedEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding on ids whose sequence is dim `output_dim` (see RowwiseParallel);
    `output_dim=None`: the whole lookup on every rank (PyTorch's layout without SP). Any
    num_embeddings: a vocabulary p does not divide is padded (vocab_parallel.py).

    Two things of the nn.Embedding it replaces are kept, as one device computes them: its
    `padding_idx` (that row gets no gradient: the lookups of that id are cut from the graph),
    and the `embed_scale` buffer of `transformers`' scaled word embeddings (Gemma's: their
    forward is the lookup times it), applied after the sum over the ranks, where each token
    is one rank's row plus zeros, so the product is one device's."""

    def __init__(self, embedding, tp_group, output_dim, where):
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, tp_group=tp_group,
                         sequence_parallel=output_dim is not None,
                         device=embedding.weight.device, dtype=embedding.weight.dtype,
                         init_weights=False)
        self.output_dim = output_dim
        self.where = where
        self.padding_idx = embedding.padding_idx
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = None if scale is None else torch.as_tensor(scale).detach().clone()

    def lookup(self, input_ids):
        x = super().lookup(input_ids)
        if self.padding_idx is None:
            return x
        return torch.where((input_ids == self.padding_idx).unsqueeze(-1), x.detach(), x)

    def forward(self, ids):
        if not self.sequence_parallel:  # lookup + `g`: [..., h] on every rank
            x = super().forward(ids)
        else:
            ids = to_sequence_first(ids, self.output_dim, group_size(self.tp_group), self.where,
                                    whole=True)
            x = super().forward(ids).transpose(0, self.output_dim).contiguous()
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.device, x.dtype)
        return x


def _conv_repr(layer):
    """The convolution's own terms in print(model), not the Linear's features it is built on."""
    full = full_shape(layer.weight, layout_of(layer, "weight"), layer.tp_size)
    return f"1x1 Conv2d, full weight {full}, tp_size={layer.tp_size}"


def _as_conv(weight):
    """A layer's `[rows, cols]` weight as a 1x1 convolution's `[rows, cols, 1, 1]` (a view):
    checkpoints and gradients then read as the nn.Conv2d's own."""
    return weight[..., None, None]


class PlannedConvColumn(ColumnParallelLinear):
    """A 1x1 nn.Conv2d split by output channels, classic TP: `[B, in, H, W]` whole on every rank
    -> `[B, out/p, H, W]`. A 1x1 convolution is a Linear over the channels (dim 1) at every
    pixel, so its rows split as a column layer's (an output_shape too), and it runs as the
    column layer's operation (`f` + GEMM) with the channels moved last. Weight
    `[out/p, in, 1, 1]`, bias `[out/p]`."""

    random_stream = None

    def __init__(self, conv, tp_group, output_shape, split_dim, where):
        super().__init__(conv.in_channels, output_shape or conv.out_channels, tp_group=tp_group,
                         bias=conv.bias is not None, split_dim=split_dim,
                         sequence_parallel=False, device=conv.weight.device,
                         dtype=conv.weight.dtype, init_weights=False)
        self.weight = nn.Parameter(_as_conv(self.weight.detach()))
        self.where = where

    def forward(self, x):
        y = column_parallel_linear(x.movedim(1, -1), self.weight.flatten(1), self.bias,
                                   self.tp_group, sequence_parallel=False).movedim(-1, 1)
        if self.random_stream is not None:  # the TP region, as PlannedColumn's
            self.random_stream.enter(y.device)
        return y

    extra_repr = _conv_repr


class PlannedConvRow(RowParallelLinear):
    """A 1x1 nn.Conv2d split by input channels, classic TP: `[B, in/p, H, W]` -> `[B, out, H,
    W]` on every rank, the row layer's operation (GEMM + `g`, then the bias `[out]`, replicated,
    once) with the channels moved last. Weight `[out, in/p, 1, 1]`."""

    random_stream = None

    def __init__(self, conv, tp_group, where):
        super().__init__(conv.in_channels, conv.out_channels, tp_group=tp_group,
                         bias=conv.bias is not None, sequence_parallel=False,
                         device=conv.weight.device, dtype=conv.weight.dtype, init_weights=False)
        self.weight = nn.Parameter(_as_conv(self.weight.detach()))
        self.where = where

    def forward(self, x):
        if self.random_stream is not None:
            self.random_stream.leave()
        return row_parallel_linear(x.movedim(1, -1), self.weight.flatten(1), self.bias,
                                   self.tp_group, sequence_parallel=False).movedim(-1, 1)

    extra_repr = _conv_repr


class SequenceParallelDropout(nn.Module):
    """Dropout on this rank's slice (along `dim`) of a tensor p times as long there, with the
    mask one device would draw for the whole tensor: every rank draws it (same generator state)
    and keeps its slice, so ranks mask different rows differently and equal one device. Inside
    the TP region too (`dim` the heads): it draws from the stream every rank shares."""

    random_stream = None

    def __init__(self, p, dim, tp_group):
        super().__init__()
        self.p, self.dim, self.tp_group = p, dim, tp_group

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        n = group_size(self.tp_group)
        full = list(x.shape)
        full[self.dim] *= n
        with self.random_stream.normal_stream() if self.random_stream else nullcontext():
            mask = F.dropout(x.new_ones(full), self.p, training=True)  # 0 or 1/(1-p), one device's
        return x * mask.chunk(n, dim=self.dim)[group_rank(self.tp_group)]

    def extra_repr(self):
        return f"p={self.p}, sequence_dim={self.dim}"


class _SumOverSplitFeatures(torch.autograd.Function):
    """forward: all-reduce (sum); backward: all-reduce (sum). Its own conjugate.

    A statistic of features split over the ranks: each rank's partial sum `[..., 1]` (over its
    n/p features) becomes the whole sum S `[..., 1]` on every rank. Unlike `g` (all-reduce,
    backward identity), what follows is not the same computation on every rank: rank q uses S
    on its own n/p features, so the loss depends on S through every rank's slice, and each
    rank's backward holds only its slice's part, dL_q/dS. Every partial sum s_r enters S with
    weight 1, so dL/ds_r = dL/dS = sum_q dL_q/dS: an all-reduce again. In matrix terms the
    forward is the p x p matrix of ones (sum, and give everyone the sum), its own transpose.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.clone(), ctx.group), None


def sum_over_split_features(x, group):
    """A per-rank partial sum `[..., 1]` -> the sum over the group on every rank; backward the
    same (see _SumOverSplitFeatures)."""
    if group_size(group) == 1:
        return x
    return _SumOverSplitFeatures.apply(x, group)


def rms_norm_eps(norm, where):
    """The eps of `norm` if it computes `weight * x * rsqrt(mean(x^2, -1) + eps)` with one 1-D
    `weight` and nothing else (nn.RMSNorm, transformers' plain RMSNorms), checked on a random
    input: a norm that centres (LayerNorm) or scales by 1 + weight (Gemma's) would be replaced
    by another function. One line otherwise."""
    params = dict(norm.named_parameters(recurse=False))
    weight = params.get("weight")
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if len(params) != 1 or weight is None or weight.dim() != 1 or eps is None:
        raise ValueError(f"{where}: {type(norm).__name__} with parameters "
                         f"{ {n: list(t.shape) for n, t in params.items()} } and eps={eps!r}: "
                         f"valid is an RMSNorm with one 1-D weight and an eps (variance_epsilon)")
    with torch.no_grad():
        x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0))
        x = x.to(weight.device, weight.dtype)
        want = weight.float() * x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                                        + eps)
        got = norm(x).float()
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item()):
        raise ValueError(f"{where}: {type(norm).__name__}'s forward is not weight * x / "
                         f"rms(x) over its last dim (it differs by "
                         f"{(got - want).abs().max().item():.3g} on a random input); only a "
                         f"plain RMSNorm is split over its features")
    return float(eps)


class PlannedNormOverSplit(nn.Module):
    """An RMSNorm over n features split over the ranks as a column layer's output (OLMo 2's
    q_norm over every head, after q_proj split by heads): x `[..., n/p]` this rank's features,
    weight `[n/p]` this rank's slice of the norm's (split, not replicated), out `[..., n/p]`.

        ss_r = sum_j x_rj^2                         [..., 1], this rank's features
        S    = sum_r ss_r                           one all-reduce of [..., 1] floats
        u_r  = x_r * rsqrt(S / n + eps)             this rank's features, normalised
        y_r  = w_r * u_r

    Backward, g_r = dL/dy_r: dL/dw_r = sum over rows of g_r * u_r, whole on this rank (no other
    rank uses w_r: nothing to sum). With a = rsqrt(S / n + eps), dL/dS = -(a^3 / 2n) times the
    sum over ALL n features of w * g * x: every rank's partial sum, so the statistic's
    gradient is all-reduced (sum_over_split_features's backward), and dL/dx_r = a * w_r * g_r
    + 2 x_r dL/dS. Two all-reduces of `[..., 1]` a step, where transformers' plan gathers the
    `[..., n]` projection on every rank. Computed in fp32 and cast back to the input's dtype,
    as transformers' RMSNorm is.
    """

    def __init__(self, norm, tp_group, eps, where):
        super().__init__()
        p = group_size(tp_group)
        self.tp_group, self.eps, self.where = tp_group, eps, where
        self.full_features = norm.weight.shape[0]  # n: the mean is over all of them
        self.weight = nn.Parameter(norm.weight.new_empty(self.full_features // p))
        set_layout(self, "weight", dim=0, init_std=None)  # rows r*n/p:(r+1)*n/p on rank r

    def forward(self, x):
        if x.shape[-1] != self.weight.shape[0]:  # before the collective
            raise ValueError(f"{self.where}: input of shape {list(x.shape)}: valid is this "
                             f"rank's {self.weight.shape[0]} of the norm's {self.full_features} "
                             f"features, a column layer's output")
        dtype, x = x.dtype, x.float()
        sum_sq = sum_over_split_features(x.pow(2).sum(-1, keepdim=True), self.tp_group)
        x = x * torch.rsqrt(sum_sq / self.full_features + self.eps)
        return (self.weight * x).to(dtype)

    def extra_repr(self):
        return f"features {self.weight.shape[0]} of {self.full_features}, eps={self.eps}"


class _GatherSequence(torch.autograd.Function):
    """forward: all-gather along the sequence dim `dim` ([.., s/p, ..] -> [.., s, ..] on every
    rank); backward: this rank's slice of the gradient. Conjugate of _SplitSequence.

    Into a replicated region (PrepareModuleInput / PrepareModuleOutput, Shard(d) ->
    Replicate()): what follows computes the same thing from the same data on every rank, or
    sums its partial gradients itself (a column layer's `f`), so the gradient that comes back
    is whole and the same everywhere, and each rank keeps its own rows of it.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        full, _ = all_gather_seq(x.transpose(0, dim), group)
        return full.transpose(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        rank, p = group_rank(ctx.group), group_size(ctx.group)
        return grad.chunk(p, dim=ctx.dim)[rank].contiguous(), None, None


class _SplitSequence(torch.autograd.Function):
    """forward: this rank's slice along the sequence dim `dim` (no communication); backward:
    all-gather of the slices' gradients, the whole gradient of the replicated input, the same
    on every rank. Conjugate of _GatherSequence (Replicate() -> Shard(d))."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        rank, p = group_rank(group), group_size(group)
        return x.chunk(p, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        full, _ = all_gather_seq(grad.transpose(0, ctx.dim), ctx.group)
        return full.transpose(0, ctx.dim).contiguous(), None, None


def gather_sequence(x, dim, group):
    """[.., s/p, ..] (dim `dim`) -> [.., s, ..] on every rank; backward: this rank's slice."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, dim, group)


class _GatheredForColumns(torch.autograd.Function):
    """forward: the gathered input again (no communication: the gather has run); backward:
    reduce-scatter along `dim`. Conjugate of all-gather, as in a Megatron column layer.

    The column layers that read a module's gathered input (an attention's q, k and v) each
    give back a partial input gradient (their weight rows are this rank's); one `f` apiece
    would all-reduce each, and the gather's backward then keep this rank's rows. Reading this
    tensor instead, they skip `f`: autograd adds their partials here, and one reduce-scatter
    sums them over the ranks and keeps this rank's rows: the same gradient for half the bytes
    (p = 2), as Megatron's all-gather + GEMM. Whatever else the module does with its input
    reads the gathered tensor itself, whose backward stays a slice: correct either way."""

    @staticmethod
    def forward(ctx, shard, gathered, dim, group):
        ctx.dim, ctx.group = dim, group
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx, grad):
        part, _ = reduce_scatter_seq(grad.movedim(ctx.dim, 0), ctx.group)
        return part.movedim(0, ctx.dim), None, None, None


def for_column_layers(x):
    """The tensor a column layer (input Replicate()) multiplies instead of `x` and without `f`,
    where `x` is a module's input gathered by `redistribute` (see _GatheredForColumns); None
    for any other input. One per gathered input, shared by its column layers."""
    source = getattr(x, "_tp_gathered_from", None)
    if source is None:
        return None
    if getattr(x, "_tp_for_columns", None) is None:
        x._tp_for_columns = _GatheredForColumns.apply(*source[:1], x.detach(), *source[1:])
    return x._tp_for_columns


def split_sequence(x, dim, group):
    """[.., s, ..] the same on every rank -> this rank's [.., s/p, ..]; backward: all-gather."""
    return x if group_size(group) == 1 else _SplitSequence.apply(x, dim, group)


def redistribute(x, have, want, group, where):
    """x from layout `have` to `want`: Shard(d) <-> Replicate() along the sequence dim d."""
    if have is None or want is None or have == want or not torch.is_tensor(x) or \
            group_size(group) == 1:
        return x
    if isinstance(have, Shard) and isinstance(want, Replicate):
        to_sequence_first(x, have.dim, group_size(group), where)
        full = gather_sequence(x, have.dim, group)
        full._tp_gathered_from = (x, have.dim, group)  # for its column layers: for_column_layers
        return full
    to_sequence_first(x, want.dim, group_size(group), where, whole=True)
    return split_sequence(x, want.dim, group)

__all__ = ["PlannedColumn", "PlannedConvColumn", "PlannedConvRow", "PlannedEmbedding",
           "PlannedNormOverSplit", "PlannedRow", "SequenceParallelDropout", "for_column_layers",
           "gather_sequence",
           "redistribute", "rms_norm_eps", "split_sequence", "sum_over_split_features",
           "to_sequence_first"]
