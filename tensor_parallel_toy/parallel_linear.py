"""Column- and row-parallel linear layers with sequence parallelism, written as autograd Functions.

Notation: p = TP size, r = this rank's index in `tp_group`, s = sequence, b = batch.

ColumnParallelLinear   Y = X W^T, W split by rows (output features)
    X_r  [s/p, b, in]  --all-gather(seq)-->  X [s, b, in]  --GEMM with W_r [out/p, in]-->
    Y_r  [s, b, out/p]
    backward:  dX = dY_r W_r           [s, b, in], a partial sum over ranks -> reduce-scatter(seq)
               dW_r = dY_r^T X         needs the full X: re-gathered from the saved X_r

RowParallelLinear      Y = X W^T, W split by columns (input features)
    X_r  [s, b, in/p]  --GEMM with W_r [out, in/p]-->  partial Y [s, b, out]
                       --reduce-scatter(seq)-->  Y_r [s/p, b, out]
    backward:  dY = all-gather(seq) of dY_r   [s, b, out]
               dX_r = dY W_r  [s, b, in/p],   dW_r = dY^T X_r  [out, in/p]

Each forward collective's backward is its conjugate (all-gather <-> reduce-scatter), because the
transpose of "copy my block to everyone" is "sum everyone's copy of my block".

Two Functions per layer: the basic one calls the collectives whole; the overlapped one cuts the
GEMM into p sequence chunks and moves the chunks around a P2P ring (see ring.py) so that the
transfer of one chunk runs under the GEMM of another. Both give the same numbers up to the
order of fp32 additions. `column_parallel_linear` and `row_parallel_linear` are the two
operations as plain functions, each picking its Function (`overlap=True`: the ring version);
the Modules hold a weight shard and call them.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import (all_gather_seq, all_reduce_, copy_to_row_holders, group_rank, group_size,
                   reduce_scatter_seq)
from .config import check_divisible


# ----------------------------------------------------------------------------------------------
# What each rank holds of a weight: marks on the Parameter (Megatron's layers do the same)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RowSplit:
    """Which rows (dim 0) of a full tensor each TP rank holds: `rows[r]`, rank r's rows in the
    order it keeps them (an int64 tensor `[p, n]`), when that is not one contiguous block per
    rank. A row may be held by several ranks (shared k/v heads): their copies are equal, and
    the layer sends them through `f` over their holders, so each copy's gradient is the sum."""
    rows: torch.Tensor

    def shared(self, rank):
        """(local, slot, n): this rank's rows that other ranks hold too (local indices), their
        positions among all n such rows of the full tensor; None when no row is shared."""
        every = torch.nonzero(torch.bincount(self.rows.flatten()) > 1).flatten()
        if len(every) == 0:
            return None
        local = torch.nonzero(torch.isin(self.rows[rank], every)).flatten()
        return local, torch.searchsorted(every, self.rows[rank][local]), len(every)


def split_rows(shape, split_dim, p, name="out_features"):
    """The `RowSplit` of a tensor whose dim 0 flattens `shape`, split along `split_dim` of it
    into p equal slices, slice r on rank r (gate and up `(2, m)` along m)."""
    if shape[split_dim] % p:
        raise ValueError(f"{name}={tuple(shape)} split along dim {split_dim} over the "
                         f"tensor-parallel size {p}: {shape[split_dim]} must be a multiple of "
                         f"{p}")
    ids = torch.arange(math.prod(shape)).view(shape)
    return RowSplit(torch.stack([c.flatten() for c in ids.chunk(p, dim=split_dim)]))


def mark_tensor_parallel(param, dim, rows=None):
    """`param.tensor_parallel_dim`: the dim split over the TP ranks (None: every rank holds it
    whole); `param.tensor_parallel_rows`: a `RowSplit` when dim 0 is split unevenly. Whatever
    must treat parameters differently (checkpoints, gradient norms, checks) reads these marks,
    never a parameter's name. Returns `param`."""
    param.tensor_parallel_dim = dim
    if rows is not None:
        param.tensor_parallel_rows = rows
    return param


def full_shape(param, tp_size, layout=None):
    """The shape of the whole parameter of which `param` is this rank's shard (`layout`: an
    object carrying the marks instead of `param`)."""
    marks, shape = layout or param, list(param.shape)
    if getattr(marks, "tensor_parallel_rows", None) is not None:
        shape[0] = int(marks.tensor_parallel_rows.rows.max()) + 1
    elif getattr(marks, "tensor_parallel_dim", None) is not None:
        shape[marks.tensor_parallel_dim] *= tp_size
    return shape


def shard(full, param, group, layout=None):
    """This rank's part of the full tensor `full`, in `param`'s marks (or `layout`'s)."""
    marks, p = layout or param, group_size(group)
    if getattr(marks, "tensor_parallel_dim", None) is None or p == 1:
        return full
    if getattr(marks, "tensor_parallel_rows", None) is not None:
        return full[marks.tensor_parallel_rows.rows[group_rank(group)].to(full.device)]
    return full.chunk(p, dim=marks.tensor_parallel_dim)[group_rank(group)]


@torch.no_grad()
def init_from_full_(param, init, group):
    """Fill `param` with this rank's part of one full tensor that `init(full)` fills in place:
    every rank draws the same full tensor (same generator state) and keeps its part, so the
    shards together are the unsplit layer's init, and the generators stay in step."""
    full = torch.empty(full_shape(param, group_size(group)), device=param.device,
                       dtype=param.dtype)
    init(full)
    return param.copy_(shard(full, param, group))


def flat(t):
    """[s, b, n] -> [s*b, n] view (the layers' GEMMs are plain 2-D matmuls)."""
    return t.reshape(-1, t.shape[-1])


def bias_grad(dy):
    """The gradient of a bias added to each of dy's rows: their sum."""
    return flat(dy).sum(dim=0)


# ----------------------------------------------------------------------------------------------
# Column parallel: all-gather + GEMM
# ----------------------------------------------------------------------------------------------
class _AllGatherGemm(torch.autograd.Function):
    """forward: all-gather(seq) then GEMM; backward: GEMM then reduce-scatter(seq).

    The all-gather is sequence parallelism's entry into the tensor-parallel region (Korthikanti
    et al., arXiv:2205.05198), fused with the GEMM it feeds; the backward's reduce-scatter is
    its conjugate.

    Saves only the local shard X_r (s/p rows), not the gathered X: keeping X would cost p times
    the activation memory that sequence parallelism exists to save. Backward re-gathers X while
    the dX GEMM runs, then starts the dX reduce-scatter before the dW GEMM so that they overlap.
    """

    @staticmethod
    def forward(ctx, x_local, weight, bias, group):
        x_full, _ = all_gather_seq(x_local, group)
        ctx.save_for_backward(x_local, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x_full, weight, bias)  # [s, b, out/p]

    @staticmethod
    def backward(ctx, dy):
        x_local, weight = ctx.saved_tensors
        dy = dy.contiguous()
        x_full, gather = all_gather_seq(x_local, ctx.group, async_op=True)
        dx_full = dy.matmul(weight)  # [s, b, in], runs while X is re-gathered
        if gather is not None:
            gather.wait()
        dx_local, scatter = reduce_scatter_seq(dx_full, ctx.group, async_op=True)
        dw = flat(dy).t().mm(flat(x_full))  # [out/p, in], runs while dX is reduce-scattered
        db = bias_grad(dy) if ctx.has_bias else None
        if scatter is not None:
            scatter.wait()
        return dx_local, dw, db, None


# ----------------------------------------------------------------------------------------------
# Row parallel: GEMM + reduce-scatter
# ----------------------------------------------------------------------------------------------
def reduced_bias_grad(dy_local, group):
    """The bias is added after the reduce-scatter, to this rank's s/p rows only, so each rank's
    bias gradient covers its own rows: sum them over the group to get the full gradient."""
    return all_reduce_(bias_grad(dy_local), group)


def finish_row_forward(ctx, y_local, x, weight, bias, group):
    """The tail both row forwards share: add the replicated bias to this rank's rows (once,
    after the sum), and keep what backward needs."""
    if bias is not None:
        y_local = y_local + bias
    ctx.save_for_backward(x, weight)
    ctx.group, ctx.has_bias = group, bias is not None
    return y_local


class _GemmReduceScatter(torch.autograd.Function):
    """forward: GEMM then reduce-scatter(seq); backward: all-gather(seq) then GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        y_partial = F.linear(x, weight)  # [s, b, out], a partial sum over the in/p slices
        y_local, _ = reduce_scatter_seq(y_partial, group)  # [s/p, b, out]
        return finish_row_forward(ctx, y_local, x, weight, bias, group)

    @staticmethod
    def backward(ctx, dy_local):
        x, weight = ctx.saved_tensors
        dy, _ = all_gather_seq(dy_local.contiguous(), ctx.group)  # [s, b, out]
        dx = dy.matmul(weight)  # [s, b, in/p]
        dw = flat(dy).t().mm(flat(x))  # [out, in/p]
        db = reduced_bias_grad(dy_local, ctx.group) if ctx.has_bias else None
        return dx, dw, db, None


# ----------------------------------------------------------------------------------------------
# The two operations as functions, and the Modules that hold their weight shards
# ----------------------------------------------------------------------------------------------
def column_parallel_linear(x, weight, bias, group, overlap=False, ring_pieces=1):
    """All-gather the sequence, then `x W^T + b` with this rank's rows of W.

    x `[s/p, b, in]` (this rank's sequence rows), weight `[out/p, in]`, bias `[out/p]` or None
    -> `[s, b, out/p]`. Backward: dX reduce-scattered back to `[s/p, b, in]`. `overlap=True`
    runs the ring version (ring.py), each chunk cut into `ring_pieces` transfers. A group of
    one rank (or None) is a plain `F.linear`.
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    if not overlap:
        return _AllGatherGemm.apply(x, weight, bias, group)
    from .ring import RingAllGatherGemm  # the overlap, read last: a client of these layers
    return RingAllGatherGemm.apply(x, weight, bias, group, ring_pieces)


def row_parallel_linear(x, weight, bias, group, overlap=False, ring_pieces=1):
    """`x W^T` with this rank's columns of W, reduce-scattered along the sequence, plus b.

    x `[s, b, in/p]` (this rank's features), weight `[out, in/p]`, bias `[out]` (replicated)
    or None -> `[s/p, b, out]`, this rank's rows of the sum over ranks. Backward: dY is
    all-gathered along the sequence. s must be a multiple of the group size. `overlap`,
    `ring_pieces`: as in `column_parallel_linear`. A group of one rank (or None) is a plain
    `F.linear`.
    """
    p = group_size(group)
    if p == 1:
        return F.linear(x, weight, bias)
    check_divisible("sequence length", x.shape[0], p, "pad the sequence (the Transformer does)")
    if not overlap:
        return _GemmReduceScatter.apply(x, weight, bias, group)
    from .ring import GemmRingReduceScatter
    return GemmRingReduceScatter.apply(x, weight, bias, group, ring_pieces)


class _ParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, tp_group, bias, overlap, ring_pieces,
                 split_dim, device=None, dtype=None, init_weights=True, rows=None):
        super().__init__()
        p = group_size(tp_group)
        if rows is not None:  # this rank's rows, in its order
            out_rows = rows.rows.shape[1]
        else:
            check_divisible("out_features" if split_dim == 0 else "in_features",
                            (out_features, in_features)[split_dim], p)
            out_rows = out_features // p if split_dim == 0 else out_features
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size, self.overlap = tp_group, p, overlap
        self.ring_pieces = ring_pieces
        shape = [out_rows, in_features // p if split_dim == 1 else in_features]
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(shape, device=device, dtype=dtype)), split_dim, rows)
        self.bias = None
        if bias:  # a column layer's bias is split with its rows; a row layer's is replicated
            self.bias = mark_tensor_parallel(
                nn.Parameter(torch.zeros(out_rows, device=device, dtype=dtype)),
                0 if split_dim == 0 else None, rows)
        if init_weights:  # nn.Linear's init of the *full* weight; this rank keeps its slice
            bound = 1 / math.sqrt(in_features)
            init_from_full_(self.weight, lambda full: nn.init.uniform_(full, -bound, bound),
                            tp_group)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp_size={self.tp_size}, bias={self.bias is not None}, overlap={self.overlap}")


class ColumnParallelLinear(_ParallelLinear):
    """Input `[s/p, b, in]` (sequence shard) -> output `[s, b, out/p]` (feature shard).

    Weight shard `[out/p, in]` = rows r*out/p:(r+1)*out/p of the full weight; bias `[out/p]`.

    `out_features` may be a shape, for outputs that are several things side by side: the full
    weight is then `[prod(shape), in]`, its rows that shape flattened, and `split_dim` says
    which dim of the shape is split over the ranks. SwiGLU's gate and up are `(2, m)` split
    along 1: rank r holds its m/p gate rows, then its m/p up rows, `[2m/p, in]`; a fused q|k|v
    `(3, heads, hd)` split along 1 gives each rank its q, k and v of its heads. Or `rows` (a
    `RowSplit`) says which of the out_features rows each rank holds, any of them on several
    ranks: those enter the GEMM through `f` over the ranks holding them
    (`comm.copy_to_row_holders`), as attention's shared k/v rows do (model.qkv_rows). Either
    way the shard is one `[rows, in]` weight: one GEMM, whose output `[s, b, rows]` the
    caller unflattens into its part of the shape.

    `init_weights`: draw the full weight as nn.Linear does and keep this rank's slice (a model
    that draws all its weights at once, as `Transformer` does, passes False).
    """

    def __init__(self, in_features, out_features, *, tp_group, bias=False, overlap=False,
                 ring_pieces=1, split_dim=0, rows=None, device=None, dtype=None,
                 init_weights=True):
        shaped = not isinstance(out_features, int)
        if not shaped and split_dim != 0:
            raise ValueError(f"split_dim={split_dim} with out_features={out_features}: it "
                             f"describes an output shape; give out_features as a tuple, or "
                             f"leave it at 0")
        if shaped:
            rows = split_rows(out_features, split_dim, group_size(tp_group))
        super().__init__(in_features, out_features, tp_group, bias, overlap, ring_pieces, 0,
                         device, dtype, init_weights, rows)
        self.shared = None if rows is None else rows.shared(group_rank(tp_group))

    def forward(self, x):
        weight, bias = self.weight, self.bias
        if self.shared is not None:  # rows other ranks hold too: `f` over their holders
            weight = copy_to_row_holders(weight, self.shared, self.tp_group)
            if bias is not None:
                bias = copy_to_row_holders(bias, self.shared, self.tp_group)
        return column_parallel_linear(x, weight, bias, self.tp_group, self.overlap,
                                      self.ring_pieces)


class RowParallelLinear(_ParallelLinear):
    """Input `[s, b, in/p]` (feature shard) -> output `[s/p, b, out]` (sequence shard).

    Weight shard `[out, in/p]` = columns r*in/p:(r+1)*in/p of the full weight; the bias `[out]`
    is replicated and added after the reduce-scatter (its gradient is summed over the group).
    `init_weights`: as for ColumnParallelLinear.
    """

    def __init__(self, in_features, out_features, *, tp_group, bias=False, overlap=False,
                 ring_pieces=1, device=None, dtype=None, init_weights=True):
        super().__init__(in_features, out_features, tp_group, bias, overlap, ring_pieces, 1,
                         device, dtype, init_weights)

    def forward(self, x):
        return row_parallel_linear(x, self.weight, self.bias, self.tp_group, self.overlap,
                                   self.ring_pieces)


def column_parallel_or_plain(in_features, out_features, tp_group=None, overlap=False,
                             bias=False, split_dim=0, rows=None):
    """`nn.Linear` for the non-TP baseline (tp_group=None; a shaped `out_features` flattened),
    else a ColumnParallelLinear whose weights the model draws (`init_weights=False`). Either
    way the output is `[..., rows]` with the rows in the same order."""
    if tp_group is None:
        rows = out_features if isinstance(out_features, int) else math.prod(out_features)
        return nn.Linear(in_features, rows, bias=bias)
    return ColumnParallelLinear(in_features, out_features, tp_group=tp_group, bias=bias,
                                overlap=overlap, split_dim=split_dim, rows=rows,
                                init_weights=False)


def row_parallel_or_plain(in_features, out_features, tp_group=None, overlap=False,
                          bias=False):
    """`nn.Linear` for the non-TP baseline (tp_group=None), else a RowParallelLinear whose
    weights the model draws (`init_weights=False`)."""
    if tp_group is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, tp_group=tp_group, bias=bias,
                             overlap=overlap, init_weights=False)
