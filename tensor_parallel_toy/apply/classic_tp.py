"""Classic tensor parallelism for a model of your own, as a plan: blocks opt in by naming two
sublayers, and `classic_plan` reads those names into a plan for `parallelize_module`.

    class FeedForward(nn.Module):
        tp_column = "net.0"   # dotted path to the column-parallel layer ("net.0": in a Sequential)
        tp_row = "net.2"      # dotted path to the row-parallel layer

    apply_tensor_parallel(model, tp_group)   # = parallelize_module(model, g, classic_plan(model))

This is classic Megatron TP, without sequence parallelism: every rank holds the full
activations between blocks, and inside a block its slice of the hidden features. In a plan's
words, ColwiseParallel() and RowwiseParallel() with their default layouts:

    x (full, every rank) --f--> column: x W_r^T + b_r  [..., hidden/p]   (no communication)
                         --element-wise op (GELU...)-->
                         --> row: partial x_r V_r^T  [..., out] --g--> sum over ranks, + b

`f` (forward identity, backward all-reduce) and `g` (forward all-reduce, backward identity) are
conjugates, in comm.py. Whatever runs between the two layers must act on each feature alone
(an activation, dropout): that is what a block promises by opting in. Everything else sees the
same full activations on every rank, so its parameters stay whole: NoParallel().

A fused projection (one Linear producing q|k|v, or gate|up) is split per part by the plan's
ColwiseParallel(output_shape=..., split_dim=...): print the plan, give that entry the shape,
and call parallelize_module yourself (README). As plain rows, rank 0 would get all of q and
half of k, and nothing would fail (every rank wrong the same way).

Supported layers: nn.Linear (features on the last dim) and 1x1 nn.Conv2d (channels on dim 1,
`[B, C, H, W]`). A convolution with any other kernel, stride, padding, dilation or groups is
refused (plan.py): it is not a per-pixel matmul.
"""
import torch
import torch.nn as nn

from ..comm import all_reduce_, group_size
from ..support.sharding import named_layouts
from .plan import parallelize_module
from .styles import ColwiseParallel, NoParallel, RowwiseParallel

# The class attributes a block declares its layers with; the underscored names are the ones
# this package first published, still accepted.
DECLARATIONS = {"tp_column": "_tp_col", "tp_row": "_tp_row"}


# ----------------------------------------------------------------------------------------------
# Reading the declarations
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


def _refuse_shapes(block, name, where):
    """The fused projection's one spelling is the plan's: an older declaration is refused with
    the entry that replaces it."""
    declared = getattr(block, "tp_column_shapes", None)
    if not declared:
        return
    path, value = next(iter(declared.items()))
    key = f"{name}.{path}" if name else path
    try:
        shape, split_dim = value
        spelled = f"ColwiseParallel(output_shape={tuple(shape)}, split_dim={split_dim})"
    except (TypeError, ValueError):
        spelled = "ColwiseParallel(output_shape=(3, n_head, head_dim), split_dim=1)"
    raise ValueError(f"{where} declares tp_column_shapes, which is no longer read: give the "
                     f"shape in the plan, plan = classic_plan(model); plan[{key!r}] = "
                     f"{spelled}; parallelize_module(model, group, plan)")


def _keep_whole(module, split, name=""):
    """{name: NoParallel()} keeping whole every parameter outside the `split` layers: a subtree
    holding none of them in one entry, a module holding some beside parameters of its own in
    an entry of its own, and every dropout with p > 0 in one too (the plan asks where each
    dropout runs; in classic TP it draws from the stream of the region it runs in)."""
    if name in split:
        return {}
    plan = {}
    if any(name == "" or s.startswith(name + ".") for s in split):
        if any(True for _ in module.parameters(recurse=False)):
            plan[name] = NoParallel()
        for child_name, child in module.named_children():
            plan.update(_keep_whole(child, split, f"{name}.{child_name}" if name else child_name))
        return plan
    if any(True for _ in module.parameters()):
        plan[name] = NoParallel()
    for sub_name, sub in module.named_modules(prefix=name):
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            plan[sub_name] = NoParallel()
    return plan


def classic_plan(model):
    """The plan of classic TP for `model`, read from its blocks' declarations: {module name:
    ColwiseParallel() for each `tp_column` layer, RowwiseParallel() for each `tp_row` layer,
    NoParallel() for whatever else holds parameters (and each dropout)}, the names full paths
    from `model`. Print it, edit it (a fused projection's output_shape), and give it to
    `parallelize_module`. Nothing is changed and nothing communicated here.

    Each declaration is one dotted path or a tuple of them (e.g. two column layers, gate and
    up, feeding one row layer); `_tp_col` / `_tp_row` are accepted as their older names. A
    block declaring one without the other, a path to nothing, a layer declared twice, a layer
    that is neither an nn.Linear nor an nn.Conv2d, or a model declaring nothing is refused in
    one line; the sizes and convolution settings are checked by `parallelize_module`.
    """
    split = {}
    for name, block in model.named_modules():
        where = f"{type(block).__name__} at {name!r}" if name else type(block).__name__
        _refuse_shapes(block, name, where)
        col, row = _declared(block, "tp_column"), _declared(block, "tp_row")
        if col is None and row is None:
            continue
        if col is None or row is None:
            missing = "tp_row" if row is None else "tp_column"
            raise ValueError(f"{where} declares only one of tp_column/tp_row ({missing} is "
                             f"missing): a column layer needs its row layer to sum its outputs")
        for kind, paths, style in (("column", col, ColwiseParallel()),
                                   ("row", row, RowwiseParallel())):
            for path in _paths(paths):
                layer = _resolve(block, path, where)
                at = f"{where}, {kind} layer {path!r}"
                if not isinstance(layer, (nn.Linear, nn.Conv2d)):
                    raise ValueError(f"{at}: {type(layer).__name__} cannot be made {kind}-"
                                     f"parallel; supported are nn.Linear and 1x1 nn.Conv2d")
                key = f"{name}.{path}" if name else path
                if key in split:
                    raise ValueError(f"{at}: {key!r} is declared twice; declare each layer "
                                     f"once, in the block that holds it")
                split[key] = style
    if not split:
        raise ValueError(f"{type(model).__name__} has no block declaring tp_column and tp_row: "
                         f"nothing to split")
    plan = {**_keep_whole(model, split), **split}
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return dict(sorted(plan.items(), key=lambda item: order[item[0]]))  # the model's order


def apply_tensor_parallel(model, tp_group, *, check_replicated_grads="first", check_ids=None,
                          same_batch="check", tp_seed=None, overlap=False):
    """`parallelize_module(model, tp_group, classic_plan(model), ...)`: the declared layers of
    every block split in place, everything else kept whole; returns the model, guarded.

    The whole plan is checked before anything changes and before any communication, so a bad
    layer is one ValueError on every rank with no rank left in a collective. Every rank must
    hold the same weights beforehand (same seed or same checkpoint): each keeps its slice of
    them, and the ranks compare them. `check_replicated_grads` ("first", the default; N for
    every N-th backward; None: off) checks at the end of a backward that every parameter left
    whole has the same gradient on every rank: a weight of the block's own applied between the
    column and the row layer would not. `check_ids`, `same_batch` and `tp_seed` are
    parallelize_module's. `overlap=True` is refused: the ring overlaps the sequence all-gather
    and reduce-scatter of sequence parallelism, and classic TP has neither.
    """
    if overlap:
        raise ValueError(f"overlap={overlap!r}: classic TP has no sequence all-gather or "
                         f"reduce-scatter to overlap; leave overlap=False, or write a plan with "
                         f"sequence parallelism for parallelize_module")
    return parallelize_module(model, tp_group, classic_plan(model), check_ids=check_ids,
                              same_batch=same_batch,
                              check_replicated_grads=check_replicated_grads, tp_seed=tp_seed)


# ----------------------------------------------------------------------------------------------
# Keeping the replicas identical over a long run
# ----------------------------------------------------------------------------------------------
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
    drifting apart over a long run. Sharded parameters (their layout's `dim` set) are left
    alone: each rank's is a different slice. Call after backward, before the optimizer step.
    There is no sequence parallelism here, so no partial sums: nothing to add up in backward.
    """
    grads = {}
    for _, param, layout in named_layouts(model):
        if param.grad is not None and layout.dim is None:
            grads.setdefault(param.grad.dtype, []).append(param.grad)
    for same_dtype in grads.values():
        average_over_group_(same_dtype, tp_group)


__all__ = ["DECLARATIONS", "apply_tensor_parallel", "average_over_group_", "classic_plan",
           "sync_replicated_gradients"]
