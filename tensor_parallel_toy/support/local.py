"""A layer's work on this rank without its collectives: for clients of the kernel that place
the transfers themselves (generation's all-reduces, the two halves' split-phase transfers).

Each is the local part of the kernel layer it names, on that layer's own weight shards:

    vocab_shard_lookup(embed, ids)   VocabParallelEmbedding before its sum over ranks
    column_gemm(layer, x)            ColumnParallelLinear after its gather: x `[.., in]` whole
    row_gemm(layer, x)               RowParallelLinear before its sum: a partial `[.., out]`
    between_mlp_layers(mlp, y)       what the MLP (GELU) or SwiGLU runs between its two layers
"""
import torch.nn.functional as F

from ..comm import copy_to_row_holders


def vocab_shard_lookup(embed, ids):
    """`ids` `[...]` -> `[..., h]`: the embedding of each id in this rank's vocabulary rows,
    zeros for the others; the sum over the ranks is the lookup (a plain `nn.Embedding`: the
    lookup itself)."""
    start = getattr(embed, "vocab_start", 0)
    outside = (ids < start) | (ids >= start + embed.weight.shape[0])
    x = F.embedding((ids - start).masked_fill(outside, 0), embed.weight)
    return x.masked_fill(outside.unsqueeze(-1), 0.0)


def column_gemm(layer, x, weights=None):
    """A column layer's GEMM on the whole input `x` `[..., in]` -> `[..., rows]`: this rank's
    rows of the weight (and bias), those several ranks hold entering through `f` over their
    holders, as `ColumnParallelLinear.forward` does; or `weights`, (weight, bias) the caller
    has put through that `f` already (the two halves: once for both)."""
    if weights is not None:
        return F.linear(x, *weights)
    weight, bias, shared = layer.weight, layer.bias, getattr(layer, "shared", None)
    if shared is not None:
        weight = copy_to_row_holders(weight, shared, layer.tp_group)
        bias = None if bias is None else copy_to_row_holders(bias, shared, layer.tp_group)
    return F.linear(x, weight, bias)


def row_gemm(layer, x):
    """A row layer's GEMM on this rank's features `x` `[..., in/p]` -> its partial sum
    `[..., out]`, without the bias (added once, after the sum)."""
    return F.linear(x, layer.weight)


def between_mlp_layers(mlp, y):
    """The MLP's activation on its first layer's output: GELU, or SwiGLU's silu(gate) * up
    (this rank's gate rows, then its up rows, model.SwiGLU)."""
    if hasattr(mlp, "gate_up"):
        gate, up = y.unflatten(-1, (2, -1)).unbind(-2)
        return F.silu(gate) * up
    return F.gelu(y)
