"""Classic tensor parallelism for a model of your own: blocks opt in by naming two sublayers.

    class FeedForward(nn.Module):
        tp_column = "net.0"   # dotted path to the column-parallel layer ("net.0": in a Sequential)
        tp_row = "net.2"      # dotted path to the row-parallel layer

    apply_tensor_parallel(model, tp_group)   # every such block, converted in place

This is classic Megatron TP, without sequence parallelism: every rank holds the full
activations between blocks, and inside a block its slice of the hidden features.

    x (full, every rank) --f--> column: x W_r^T + b_r  [..., hidden/p]   (no communication)
                         --element-wise op (GELU...)-->
                         --> row: partial x_r V_r^T  [..., out] --g--> sum over ranks, + b

`f` (forward identity, backward all-reduce) and `g` (forward all-reduce, backward identity) are
conjugates, in comm.py. Whatever runs between the two layers must act on each feature alone
(an activation, dropout): that is what a block promises by opting in.

A fused projection (one Linear producing q|k|v, or gate|up) must declare its output shape
and the dim of it to split, `tp_column_shapes = {"c_attn": ((3, n_head, head_dim), 1)}` (set
in the block's `__init__`, where the sizes are known): split as plain rows, rank 0 would get
all of q and half of k, and nothing would fail (every rank wrong the same way).

Supported layers: nn.Linear (features on the last dim) and 1x1 nn.Conv2d (channels on dim 1,
`[B, C, H, W]`), the two differing only in that. A convolution with any other kernel, stride,
padding, dilation or groups is refused: it is not a per-pixel matmul, and silently dropping
those settings would change the model.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..guards.agreement import check_ranks_agree
from ..comm import (all_reduce_, copy_to_tensor_parallel_region, group_rank, group_size,
                   reduce_from_tensor_parallel_region)
from ..config import check_divisible
from ..guards.replicated_grads import check_every_option, watch_replicated_gradients
from ..support.sharding import (mark_tensor_parallel, named_layouts, record_layouts, split_rows,
                                tensor_parallel_dim)

# The class attributes a block declares its layers with; the underscored names are the ones
# this package first published, still accepted.
DECLARATIONS = {"tp_column": "_tp_col", "tp_row": "_tp_row"}


class _ClassicParallel(nn.Module):
    """This rank's shard of a Linear or 1x1 Conv2d; `split_dim` 0 splits the output features
    (column), 1 the input features (row). The weight keeps the layer's own layout: Linear
    `[out, in]`, Conv2d `[out, in, 1, 1]`, so the split dims are the same for both."""

    def __init__(self, layer, tp_group, split_dim, view=None):
        super().__init__()
        p, r = group_size(tp_group), group_rank(tp_group)
        self.tp_group, self.tp_size, self.split_dim = tp_group, p, split_dim
        self.is_conv = isinstance(layer, nn.Conv2d)
        self.full_shape = tuple(layer.weight.shape)
        # A declared output shape: this rank's rows of it, in the view's order (column only).
        rows = None if view is None else view.rows[r].to(layer.weight.device)
        cut = (lambda t: t[rows]) if view is not None else (lambda t: t.chunk(p, split_dim)[r])
        with torch.no_grad():
            self.weight = mark_tensor_parallel(nn.Parameter(cut(layer.weight).clone()),
                                               split_dim, view)
            self.bias = None
            if layer.bias is not None:
                # Column: each rank adds the bias of its own outputs. Row: the bias is added
                # once, after the sum, and is the same on every rank.
                bias = cut(layer.bias) if split_dim == 0 else layer.bias
                self.bias = mark_tensor_parallel(nn.Parameter(bias.clone()),
                                                 0 if split_dim == 0 else None, view)

    def _matmul(self, x, weight, bias):
        """The layer's own op: a 1x1 convolution is a matmul over the channel dim per pixel."""
        return F.conv2d(x, weight, bias) if self.is_conv else F.linear(x, weight, bias)

    def extra_repr(self):
        kind = "Conv2d 1x1" if self.is_conv else "Linear"
        return f"{kind}, full weight {list(self.full_shape)}, tp_size={self.tp_size}"


class ClassicColumnParallel(_ClassicParallel):
    """Full input -> this rank's output features, no communication in forward.

    Linear: `[..., in]` -> `[..., out/p]`; Conv2d 1x1: `[B, in, H, W]` -> `[B, out/p, H, W]`.
    Weight shard: output rows r*out/p:(r+1)*out/p; bias `[out/p]`. The input enters through `f`:
    each rank's input gradient covers only its outputs, so backward sums it over the group.
    """

    def __init__(self, layer, tp_group, view=None):
        super().__init__(layer, tp_group, split_dim=0, view=view)

    def forward(self, x):
        return self._matmul(copy_to_tensor_parallel_region(x, self.tp_group), self.weight,
                            self.bias)


class ClassicRowParallel(_ClassicParallel):
    """This rank's input features -> full output on every rank, via `g` (an all-reduce).

    Linear: `[..., in/p]` -> `[..., out]`; Conv2d 1x1: `[B, in/p, H, W]` -> `[B, out, H, W]`.
    Weight shard: input columns r*in/p:(r+1)*in/p; the bias `[out]` is replicated and added
    after the sum (adding it on every rank before it would count it p times).
    """

    def __init__(self, layer, tp_group):
        super().__init__(layer, tp_group, split_dim=1)

    def forward(self, x):
        y = reduce_from_tensor_parallel_region(self._matmul(x, self.weight, None), self.tp_group)
        if self.bias is None:
            return y
        return y + (self.bias.view(-1, 1, 1) if self.is_conv else self.bias)  # [C] -> [C, 1, 1]


# ----------------------------------------------------------------------------------------------
# Finding and checking the declared layers
# ----------------------------------------------------------------------------------------------
def _paths(declared):
    return (declared,) if isinstance(declared, str) else tuple(declared)


def _declared(block, name):
    """The block's `tp_column` / `tp_row` (or its older alias), None if it declares neither.
    Set on the block itself (for a model whose classes you cannot edit), it comes first; else
    the class nearest the block's own in its MRO decides, as for any inherited attribute."""
    alias = DECLARATIONS[name]
    holders = [(f"this {type(block).__name__}", vars(block))]
    holders += [(cls.__name__, cls.__dict__) for cls in type(block).__mro__]
    for who, attributes in holders:
        value, old = attributes.get(name), attributes.get(alias)
        if value is not None and old is not None and _paths(value) != _paths(old):
            raise ValueError(f"{who} declares {name}={value!r} and {alias}={old!r}; "
                             f"keep one ({alias} is the older name of {name})")
        if value is not None or old is not None:
            return value if value is not None else old
    return None


def _resolve(block, path, where):
    obj = block
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: no sublayer {path!r} ({part!r} not found in "
                             f"{type(obj).__name__})")
        obj = getattr(obj, part)
    return obj


def _output_view(block, path, layer, p, where):
    """The `RowSplit` a block declares for column layer `path` in `tp_column_shapes`
    ({path: (output_shape, split_dim)}), or None; refused in one line when it cannot hold."""
    declared = getattr(block, "tp_column_shapes", None) or {}
    if path not in declared or not isinstance(layer, (nn.Linear, nn.Conv2d)):
        return None  # another kind of layer: _check_layer refuses it
    try:
        shape, split_dim = declared[path]
        shape = tuple(shape)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: tp_column_shapes[{path!r}]={declared[path]!r}: give "
                         f"(output_shape, split_dim), e.g. ((3, n_head, head_dim), 1)") from None
    n_out = layer.out_channels if isinstance(layer, nn.Conv2d) else layer.out_features
    if math.prod(shape) != n_out or not 0 <= split_dim < len(shape) or shape[split_dim] % p:
        raise ValueError(f"{where}: output shape {shape} split along dim {split_dim}: the shape "
                         f"must hold the layer's {n_out} outputs and its dim {split_dim} divide "
                         f"by the tensor-parallel size {p}")
    return split_rows(shape, split_dim, p)


def _check_layer(layer, kind, p, where, shaped=False):
    """Refuse, with one line, any layer the classic column/row conversion cannot keep exact."""
    if isinstance(layer, nn.Conv2d):
        settings = {"kernel_size": (layer.kernel_size, (1, 1)), "stride": (layer.stride, (1, 1)),
                    "padding": (layer.padding, (0, 0)), "dilation": (layer.dilation, (1, 1)),
                    "groups": (layer.groups, 1)}
        for name, (value, plain) in settings.items():
            if value != plain and not (name == "padding" and value == "valid"):
                raise ValueError(
                    f"{where}: Conv2d {name}={value!r} is not supported; tensor parallelism "
                    f"here needs a plain 1x1 convolution (kernel_size=(1, 1), stride=(1, 1), "
                    f"padding=0, dilation=(1, 1), groups=1)")
        n_out, n_in = layer.out_channels, layer.in_channels
        names = ("out_channels", "in_channels")
    elif isinstance(layer, nn.Linear):
        n_out, n_in = layer.out_features, layer.in_features
        names = ("out_features", "in_features")
    else:
        raise ValueError(f"{where}: {type(layer).__name__} cannot be made {kind}-parallel; "
                         f"supported are nn.Linear and 1x1 nn.Conv2d")
    name, value = (names[0], n_out) if kind == "column" else (names[1], n_in)
    if not shaped:  # a declared output shape is checked by _output_view
        check_divisible(f"{where}: {name}", value, p)


def apply_tensor_parallel(model, tp_group, *, check_replicated_grads=None):
    """Convert, in place, the `tp_column` / `tp_row` layers of every block that declares them
    (`_tp_col` / `_tp_row` are accepted as their older names).

    Each declaration is one dotted path or a tuple of them (e.g. two column layers, gate and
    up, feeding one row layer). A column layer whose output is several tensors side by side (a
    fused q|k|v) needs `tp_column_shapes` (module docstring): as plain rows it is split wrong.
    The whole model is checked before anything changes, and before any communication, so a bad
    layer is one ValueError on every rank with no rank left in a collective. Every rank must
    hold the same weights beforehand (same seed or same checkpoint): each keeps its slice of
    them. Returns the model.

    `check_replicated_grads` ("first", or N for every N-th backward; None: off) checks at the
    end of a backward through `model` that every parameter left whole has the same gradient on
    every rank (replicated_grads.py): a per-feature weight placed between the column and the
    row layer would not. Every rank must pass the same value: the ranks compare it at the
    end, in one tiny all-gather, the only communication here (a rank checking alone would
    otherwise wait in the check's collective).
    """
    check_every_option(check_replicated_grads)
    p = group_size(tp_group)
    plan = []
    for name, block in list(model.named_modules()):
        col, row = _declared(block, "tp_column"), _declared(block, "tp_row")
        if col is None and row is None:
            continue
        where = f"{type(block).__name__} at {name!r}" if name else type(block).__name__
        if col is None or row is None:
            missing = "tp_row" if row is None else "tp_column"
            raise ValueError(f"{where} declares only one of tp_column/tp_row ({missing} is "
                             f"missing): a column layer needs its row layer to sum its outputs")
        for kind, paths in (("column", _paths(col)), ("row", _paths(row))):
            for path in paths:
                layer = _resolve(block, path, where)
                at = f"{where}, {kind} layer {path!r}"
                view = _output_view(block, path, layer, p, at) if kind == "column" else None
                _check_layer(layer, kind, p, at, shaped=view is not None)
                plan.append((block, path, layer, kind, view))
        unknown = set(getattr(block, "tp_column_shapes", None) or {}) - set(_paths(col))
        if unknown:
            raise ValueError(f"{where}: tp_column_shapes names {sorted(unknown)}, which "
                             f"tp_column does not ({col!r})")
    if not plan:
        raise ValueError(f"{type(model).__name__} has no block declaring tp_column and tp_row: "
                         f"nothing to split")
    for block, path, layer, kind, view in plan:
        parent_path, _, attr = path.rpartition(".")
        parent = _resolve(block, parent_path, "") if parent_path else block
        new = ClassicColumnParallel(layer, tp_group, view) if kind == "column" else \
            ClassicRowParallel(layer, tp_group)
        setattr(parent, attr, new)  # "1" in a Sequential replaces its item 1
    record_layouts(model)  # the marks, where wrapping (fully_shard, DDP) keeps them
    check_ranks_agree({"check_replicated_grads": check_replicated_grads}, tp_group,
                      "apply_tensor_parallel calls")
    model.replicated_grads_watch = watch_replicated_gradients(model, tp_group,
                                                              check_replicated_grads)
    return model


@torch.no_grad()
def average_over_group_(tensors, group):
    """Replace each tensor by its mean over the group, in place, with one all-reduce.

    The tensors are flattened into one buffer first: one collective of N elements costs far
    less than N/n collectives of n (each has a fixed latency). They must share a dtype.
    """
    tensors = list(tensors)
    p = group_size(group)
    if p == 1 or not tensors:
        return tensors
    flat = all_reduce_(torch.cat([t.reshape(-1) for t in tensors]), group)
    flat /= p
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return tensors


def sync_replicated_gradients(model, tp_group):
    """Average, over the TP group, the gradient of every parameter that is not sharded.

    Under classic TP a replicated parameter (a norm, a layer outside the blocks, a row layer's
    bias) sees the same inputs and gradients on every rank, so its gradients agree up to the
    order of floating-point operations. Averaging them at each step keeps the replicas from
    drifting apart over a long run. Sharded parameters (`tensor_parallel_dim` set) are left
    alone: each rank's is a different slice. Call after backward, before the optimizer step.
    There is no sequence parallelism here, so no partial sums: nothing to add up in backward.
    """
    grads = {}
    for _, param, layout in named_layouts(model):
        if param.grad is not None and tensor_parallel_dim(layout) is None:
            grads.setdefault(param.grad.dtype, []).append(param.grad)
    for same_dtype in grads.values():
        average_over_group_(same_dtype, tp_group)
