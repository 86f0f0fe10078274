"""Column- and row-parallel linear layers, with or without sequence parallelism, as autograd
Functions.

Notation: p = TP size, r = this rank's index in `tp_group`, s = sequence, b = batch.

Classic TP (Shoeybi et al., arXiv:1909.08053), `sequence_parallel=False`: every rank holds the
whole activation between the layers.

ColumnParallelLinear   X [.., in] (whole, every rank) --f--> GEMM with W_r [out/p, in]
                       --> Y_r [.., out/p]          (backward: dX all-reduced by `f`)
RowParallelLinear      X_r [.., in/p] --GEMM with W_r [out, in/p]--> partial Y [.., out]
                       --g--> Y [.., out] + b       (backward: dY as it is, `g`'s identity)

With sequence parallelism (Korthikanti et al., arXiv:2205.05198), the default, the activation
between the layers is split along the sequence instead, and `f` and `g` become an all-gather
and a reduce-scatter, each fused with the GEMM it feeds or follows:

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

Two Functions per layer under SP: the basic one calls the collectives whole; the overlapped one
(ring.py) cuts the GEMM into p sequence chunks and moves the chunks around a P2P ring so that
the transfer of one chunk runs under the GEMM of another. Both give the same numbers up to the
order of fp32 additions. `column_parallel_linear` and `row_parallel_linear` are the two
operations as plain functions, each picking its Function; the Modules hold a weight shard,
where it is split (`Layout`, on the module: an engine that replaces the Parameter objects keeps
the modules) and call them.
"""
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import (all_gather_seq, all_reduce_, copy_to_row_holders,
                   copy_to_tensor_parallel_region, group_rank, group_size,
                   reduce_from_tensor_parallel_region, reduce_scatter_seq)
from .config import check_divisible, padded_vocab_size
from .ring import GemmRingReduceScatter, RingAllGatherGemm, flat

DEFAULT_INIT_STD = 0.02


# ----------------------------------------------------------------------------------------------
# What each rank holds of a parameter: a Layout, kept by the module that owns it
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


@dataclass(frozen=True)
class Layout:
    """How one parameter is split over the TP ranks. `dim`: the dim split (None: every rank
    holds it whole); `rows`: a `RowSplit` when dim 0 is split unevenly; `init_std`: the std of
    the model's normal init (None: keep the values built); `full_size`: the full tensor's
    length along `dim` when the shards are of it padded with zero rows to a multiple of p (a
    vocabulary, `config.padded_vocab_size`), the padding in no full tensor. Whatever must
    treat parameters differently (checkpoints, gradient norms, checks) reads these, never a
    parameter's name."""
    dim: int | None = None
    rows: RowSplit | None = None
    init_std: float | None = DEFAULT_INIT_STD
    full_size: int | None = None


def set_layout(module, name, **layout):
    """Record how `module`'s parameter `name` is split (`Layout`'s fields), on the module:
    wrappers (`fully_shard`, DDP) replace Parameter objects but keep the modules."""
    if "layouts" not in module.__dict__:
        module.layouts = {}
    module.layouts[name] = Layout(**layout)


def layout_of(module, name):
    """The `Layout` of `module`'s own parameter `name` (a whole, N(0, 0.02) one if unset)."""
    return module.__dict__.get("layouts", {}).get(name, Layout())


def split_rows(shape, split_dim, p, name="out_features"):
    """The `RowSplit` of a tensor whose dim 0 flattens `shape`, split along `split_dim` of it
    into p equal slices, slice r on rank r (gate and up `(2, m)` along m)."""
    if shape[split_dim] % p:
        raise ValueError(f"{name}={tuple(shape)} split along dim {split_dim} over the "
                         f"tensor-parallel size {p}: {shape[split_dim]} must be a multiple of "
                         f"{p}")
    ids = torch.arange(math.prod(shape)).view(shape)
    return RowSplit(torch.stack([c.flatten() for c in ids.chunk(p, dim=split_dim)]))


def full_shape(local, layout, tp_size):
    """The shape of the whole tensor of which `local` is this rank's shard (without padding)."""
    shape = list(local.shape)
    if layout.rows is not None:
        shape[0] = int(layout.rows.rows.max()) + 1
    elif layout.dim is not None:
        shape[layout.dim] = layout.full_size or shape[layout.dim] * tp_size
    return shape


def shard(full, layout, group):
    """This rank's part of the full tensor `full`, as `layout` splits it (padding: zeros)."""
    p = group_size(group)
    if layout.dim is None or p == 1:
        return full
    if layout.rows is not None:
        return full[layout.rows.rows[group_rank(group)].to(full.device)]
    if (layout.full_size or 0) % p:  # padded: zero rows after the full tensor's end
        pad = list(full.shape)
        pad[layout.dim] = p - layout.full_size % p
        full = torch.cat([full, full.new_zeros(pad)], dim=layout.dim)
    return full.chunk(p, dim=layout.dim)[group_rank(group)]


@torch.no_grad()
def init_from_full_(param, layout, init, group):
    """Fill `param` with this rank's part of one full tensor that `init(full)` fills in place:
    every rank draws the same full tensor (same generator state) and keeps its part, so the
    shards together are the unsplit layer's init, and the generators stay in step."""
    full = torch.empty(full_shape(param, layout, group_size(group)), device=param.device,
                       dtype=param.dtype)
    init(full)
    return param.copy_(shard(full, layout, group))


def bias_grad(dy):
    """The gradient of a bias added to each of dy's rows: their sum."""
    return flat(dy).sum(dim=0)


# ----------------------------------------------------------------------------------------------
# Column parallel under SP: all-gather + GEMM
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
        ctx.group = group
        ctx.has_bias = bias is not None
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
# Row parallel under SP: GEMM + reduce-scatter
# ----------------------------------------------------------------------------------------------
class _GemmReduceScatter(torch.autograd.Function):
    """forward: GEMM then reduce-scatter(seq), then the bias; backward: all-gather(seq) then
    GEMMs. The bias is replicated and added after the reduce-scatter, to this rank's s/p rows
    only, so each rank's bias gradient covers its own rows: summed over the group."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        y_partial = F.linear(x, weight)  # [s, b, out], a partial sum over the in/p slices
        y_local, _ = reduce_scatter_seq(y_partial, group)  # [s/p, b, out]
        if bias is not None:
            y_local = y_local + bias
        ctx.save_for_backward(x, weight)
        ctx.group = group
        ctx.has_bias = bias is not None
        return y_local

    @staticmethod
    def backward(ctx, dy_local):
        x, weight = ctx.saved_tensors
        dy, _ = all_gather_seq(dy_local.contiguous(), ctx.group)  # [s, b, out]
        dx = dy.matmul(weight)  # [s, b, in/p]
        dw = flat(dy).t().mm(flat(x))  # [out, in/p]
        db = all_reduce_(bias_grad(dy_local), ctx.group) if ctx.has_bias else None
        return dx, dw, db, None


# ----------------------------------------------------------------------------------------------
# The two operations as functions, and the Modules that hold their weight shards
# ----------------------------------------------------------------------------------------------
def column_parallel_linear(x, weight, bias, group, *, sequence_parallel=True, overlap=False,
                           ring_pieces=1):
    """`x W^T + b` with this rank's rows of W: `[.., out/p]`.

    Under SP, x `[s/p, b, in]` (this rank's sequence rows) is all-gathered first -> `[s, b,
    out/p]` (backward: dX reduce-scattered); `overlap=True` runs the ring version (ring.py),
    each chunk cut into `ring_pieces` transfers. Without SP, x `[.., in]` is whole on every
    rank and enters through `f` (backward: dX all-reduced). weight `[out/p, in]`, bias
    `[out/p]` or None. A group of one rank (or None) is a plain `F.linear`.
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    if not sequence_parallel:
        return F.linear(copy_to_tensor_parallel_region(x, group), weight, bias)
    if overlap:
        return RingAllGatherGemm.apply(x, weight, bias, group, ring_pieces)
    return _AllGatherGemm.apply(x, weight, bias, group)


def row_parallel_linear(x, weight, bias, group, *, sequence_parallel=True, overlap=False,
                        ring_pieces=1):
    """`x W^T` with this rank's columns of W, summed over the group, plus b (replicated, added
    once, after the sum).

    x `[.., in/p]` (this rank's features), weight `[out, in/p]`, bias `[out]` or None. Under
    SP, x is `[s, b, in/p]` and the sum is reduce-scattered along the sequence -> `[s/p, b,
    out]`, this rank's rows (backward: dY all-gathered); s must be a multiple of the group
    size. Without SP the sum is `g`'s all-reduce -> `[.., out]` on every rank. `overlap`,
    `ring_pieces`: as in `column_parallel_linear`. A group of one rank (or None) is a plain
    `F.linear`.
    """
    p = group_size(group)
    if p == 1:
        return F.linear(x, weight, bias)
    if not sequence_parallel:
        y = reduce_from_tensor_parallel_region(F.linear(x, weight), group)
        return y if bias is None else y + bias
    check_divisible("sequence length", x.shape[0], p, "pad the sequence (the Transformer does)")
    if overlap:
        return GemmRingReduceScatter.apply(x, weight, bias, group, ring_pieces)
    return _GemmReduceScatter.apply(x, weight, bias, group)


class _ParallelLinear(nn.Module):
    """What the column and row layers share: the weight shard `[out_rows, in_cols]`, its
    layout, the switches, nn.Linear's init of the full weight (`init_weights`)."""

    def __init__(self, in_features, out_features, *, tp_group, bias, split_dim, out_rows,
                 in_cols, rows=None, full_size=None, sequence_parallel=True, overlap=False,
                 ring_pieces=1, device=None, dtype=None, init_weights=True):
        super().__init__()
        if overlap and not sequence_parallel:
            raise ValueError("overlap=True with sequence_parallel=False: the ring moves "
                             "sequence chunks; turn sequence parallelism on, or overlap off")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size = tp_group, group_size(tp_group)
        self.sequence_parallel = sequence_parallel  # generation switches it off for a call
        self.overlap, self.ring_pieces = overlap, ring_pieces
        self.weight = nn.Parameter(torch.empty(out_rows, in_cols, device=device, dtype=dtype))
        set_layout(self, "weight", dim=split_dim, rows=rows, full_size=full_size)
        self.bias = None
        if bias:  # a column layer's bias is split with its rows; a row layer's is replicated
            self.bias = nn.Parameter(torch.zeros(out_rows, device=device, dtype=dtype))
            set_layout(self, "bias", dim=0 if split_dim == 0 else None, rows=rows,
                       full_size=full_size)
        if init_weights:  # nn.Linear's init of the *full* weight; this rank keeps its slice
            bound = 1 / math.sqrt(in_features)
            init_from_full_(self.weight, layout_of(self, "weight"),
                            functools.partial(nn.init.uniform_, a=-bound, b=bound), tp_group)

    def switches(self):
        """The keyword arguments this layer passes to its operation."""
        return dict(sequence_parallel=self.sequence_parallel, overlap=self.overlap,
                    ring_pieces=self.ring_pieces)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp_size={self.tp_size}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, overlap={self.overlap}")


class ColumnParallelLinear(_ParallelLinear):
    """Input `[s/p, b, in]` (sequence shard; without SP `[.., in]`, whole) -> output `[s, b,
    out/p]` (feature shard; without SP `[.., out/p]`).

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

    `pad=True` (an LM head): an int out_features that p does not divide is padded with zero
    rows to a multiple of p (`config.padded_vocab_size`): the last ranks' last output columns
    are padding, which the caller drops (the gathered `[..., :out_features]`) or masks
    (`vocab_parallel_cross_entropy(..., vocab_size=out_features)`).

    `sequence_parallel` (default True), `overlap`, `ring_pieces`: see `column_parallel_linear`.
    `init_weights`: draw the full weight as nn.Linear does and keep this rank's slice (a model
    that draws all its weights at once, as `Transformer` does, passes False).
    """

    def __init__(self, in_features, out_features, *, tp_group, bias=False, split_dim=0,
                 rows=None, pad=False, sequence_parallel=True, overlap=False, ring_pieces=1,
                 device=None, dtype=None, init_weights=True):
        p = group_size(tp_group)
        shaped = not isinstance(out_features, int)
        if not shaped and split_dim != 0:
            raise ValueError(f"split_dim={split_dim} with out_features={out_features}: it "
                             f"describes an output shape; give out_features as a tuple, or "
                             f"leave it at 0")
        if shaped:
            rows = split_rows(out_features, split_dim, p)
        full_size = out_features if pad and rows is None else None
        if rows is None:
            if not pad:
                check_divisible("out_features", out_features, p)
            out_rows = padded_vocab_size(out_features, p) // p
        else:  # this rank's rows, in its order
            out_rows = rows.rows.shape[1]
        super().__init__(in_features, out_features, tp_group=tp_group, bias=bias, split_dim=0,
                         out_rows=out_rows, in_cols=in_features, rows=rows, full_size=full_size,
                         sequence_parallel=sequence_parallel, overlap=overlap,
                         ring_pieces=ring_pieces, device=device, dtype=dtype,
                         init_weights=init_weights)
        self.shared = None if rows is None else rows.shared(group_rank(tp_group))

    def shard_weights(self):
        """This rank's weight and bias as the GEMM uses them: the rows other ranks hold too
        enter through `f` over their holders."""
        weight, bias = self.weight, self.bias
        if self.shared is not None:
            weight = copy_to_row_holders(weight, self.shared, self.tp_group)
            if bias is not None:
                bias = copy_to_row_holders(bias, self.shared, self.tp_group)
        return weight, bias

    def gemm(self, x, weights=None):
        """The layer's work on this rank without its collective: x `[.., in]` whole (already
        gathered) -> `[.., rows]` (for a client that places the transfer itself: halves/).
        `weights`: (weight, bias) the caller already put through `shard_weights`' `f`."""
        return F.linear(x, *(weights or self.shard_weights()))

    def forward(self, x):
        weight, bias = self.shard_weights()
        return column_parallel_linear(x, weight, bias, self.tp_group, **self.switches())


class RowParallelLinear(_ParallelLinear):
    """Input `[s, b, in/p]` (feature shard) -> output `[s/p, b, out]` (sequence shard; without
    SP `[.., out]`, whole on every rank).

    Weight shard `[out, in/p]` = columns r*in/p:(r+1)*in/p of the full weight; the bias `[out]`
    is replicated and added after the sum (under SP its gradient is summed over the group).
    `sequence_parallel`, `overlap`, `ring_pieces`, `init_weights`: as for ColumnParallelLinear.
    """

    def __init__(self, in_features, out_features, *, tp_group, bias=False,
                 sequence_parallel=True, overlap=False, ring_pieces=1, device=None, dtype=None,
                 init_weights=True):
        p = group_size(tp_group)
        check_divisible("in_features", in_features, p)
        super().__init__(in_features, out_features, tp_group=tp_group, bias=bias, split_dim=1,
                         out_rows=out_features, in_cols=in_features // p,
                         sequence_parallel=sequence_parallel, overlap=overlap,
                         ring_pieces=ring_pieces, device=device, dtype=dtype,
                         init_weights=init_weights)

    def gemm(self, x):
        """The layer's work on this rank without its collective: x `[.., in/p]` -> the partial
        sum `[.., out]`, without the bias (added once, after the sum)."""
        return F.linear(x, self.weight)

    def forward(self, x):
        return row_parallel_linear(x, self.weight, self.bias, self.tp_group, **self.switches())


def column_parallel_or_plain(in_features, out_features, tp_group=None, *, bias=False,
                             split_dim=0, rows=None, pad=False, init_std=DEFAULT_INIT_STD,
                             **switches):
    """`nn.Linear` for the non-TP baseline (tp_group=None; a shaped `out_features` flattened),
    else a ColumnParallelLinear whose weights the model draws (`init_weights=False`; `pad`: see
    ColumnParallelLinear; `switches`: `sequence_parallel`, `overlap`, `ring_pieces`). Either
    way the output is `[..., rows]` with the rows in the same order."""
    if tp_group is None:
        n = out_features if isinstance(out_features, int) else math.prod(out_features)
        layer = nn.Linear(in_features, n, bias=bias)
    else:
        layer = ColumnParallelLinear(in_features, out_features, tp_group=tp_group, bias=bias,
                                     split_dim=split_dim, rows=rows, pad=pad,
                                     init_weights=False, **switches)
    split = layout_of(layer, "weight")
    set_layout(layer, "weight", dim=split.dim, rows=split.rows, full_size=split.full_size,
               init_std=init_std)
    return layer


def row_parallel_or_plain(in_features, out_features, tp_group=None, *, bias=False,
                          init_std=DEFAULT_INIT_STD, **switches):
    """`nn.Linear` for the non-TP baseline (tp_group=None), else a RowParallelLinear whose
    weights the model draws (`init_weights=False`)."""
    layer = nn.Linear(in_features, out_features, bias=bias) if tp_group is None else \
        RowParallelLinear(in_features, out_features, tp_group=tp_group, bias=bias,
                          init_weights=False, **switches)
    set_layout(layer, "weight", dim=layout_of(layer, "weight").dim, init_std=init_std)
    return layer
