"""The styles of a plan (apply/plan.py): what a plan says about one module, in PyTorch's
names and arguments; PyTorch's own style objects read into them (`translate_style`), and back
(`torch_plan`, with `rank_major_rows` for a fused projection); and the
layout helpers that read them (which dim a `Shard(d)` names, the moves a PrepareModuleInput /
Output may make, and the hooks that make them)."""
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import parallel as torch_tp

from ..parallel_linear import RowSplit, split_rows
from .layers import redistribute


# ----------------------------------------------------------------------------------------------
# The styles: what a plan says about one module
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColwiseParallel:
    """An nn.Linear's output features split over the ranks (PlannedColumn; a 1x1 nn.Conv2d's
    output channels, PlannedConvColumn)."""
    input_layouts: object = None  # None: Replicate()
    output_layouts: object = None  # None: Shard(-1)
    use_local_output: bool = True  # only True: our outputs are plain local tensors
    output_shape: tuple = None  # the rows flatten this shape (a fused projection)
    split_dim: int = 0  # the dim of output_shape split over the ranks
    output_sizes: tuple = None  # or: blocks of rows side by side, each split (block_rows)


@dataclass(frozen=True)
class RowwiseParallel:
    """An nn.Linear's input features (or an nn.Embedding's rows) split (PlannedRow / Embedding)."""
    input_layouts: object = None  # None: Shard(-1)
    output_layouts: object = None  # None: Replicate()
    use_local_output: bool = True  # only True, as ColwiseParallel


@dataclass(frozen=True)
class SequenceParallel:
    """A module on this rank's part of dim `sequence_dim`, its parameters whole, their
    gradients summed over the group; a dropout's mask one device's."""
    sequence_dim: int = 1
    use_local_output: bool = False  # either: the output is this rank's rows, a plain tensor


@dataclass(frozen=True)
class NormOverSplit:
    """An RMSNorm over features split over the ranks as a ColwiseParallel's output (one block
    of features per rank: OLMo 2's q_norm over every head, after q_proj split by heads): its
    weight split the same way, its sum of squares all-reduced (PlannedNormOverSplit). Not one
    of PyTorch's: its plans gather the projection instead."""


@dataclass(frozen=True)
class NoParallel:
    """A module whose parameters every rank holds whole and uses on the same data."""


@dataclass(frozen=True)
class PrepareModuleInput:
    """A module's inputs moved from their layouts to the desired ones (Shard(d) <-> Replicate())."""
    input_layouts: object = None  # one layout per positional input (None: not a tensor)
    desired_input_layouts: object = None
    input_kwarg_layouts: dict = None
    desired_input_kwarg_layouts: dict = None
    use_local_output: bool = False


@dataclass(frozen=True)
class PrepareModuleOutput:
    """A module's outputs moved from their layouts to the desired ones."""
    output_layouts: object = None
    desired_output_layouts: object = None
    use_local_output: bool = True


STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel, NormOverSplit, NoParallel,
          PrepareModuleInput, PrepareModuleOutput)


# ----------------------------------------------------------------------------------------------
# PyTorch's style objects, read into ours
# ----------------------------------------------------------------------------------------------
def _one(layouts):
    """PyTorch keeps a Colwise / Rowwise layout as a one-element tuple: its element."""
    return layouts[0] if isinstance(layouts, tuple) and len(layouts) == 1 else layouts


def _torch_colwise(s, where):
    return ColwiseParallel(input_layouts=_one(s.input_layouts),
                           output_layouts=_one(s.output_layouts),
                           use_local_output=s.use_local_output)


def _torch_rowwise(s, where):
    return RowwiseParallel(input_layouts=_one(s.input_layouts),
                           output_layouts=_one(s.output_layouts),
                           use_local_output=s.use_local_output)


def _torch_sequence(s, where):
    layout = _one(s.sequence_sharding)
    if not isinstance(layout, Shard):
        raise ValueError(f"{where}: PyTorch's SequenceParallel with sequence_sharding="
                         f"{s.sequence_sharding!r}: valid is (Shard(d),), d the sequence dim")
    return SequenceParallel(sequence_dim=layout.dim, use_local_output=s.use_local_output)


def _torch_input(s, where):
    return PrepareModuleInput(input_layouts=s.input_layouts,
                              desired_input_layouts=s.desired_input_layouts,
                              input_kwarg_layouts=s.input_kwarg_layouts or None,
                              desired_input_kwarg_layouts=s.desired_input_kwarg_layouts or None,
                              use_local_output=s.use_local_output)


def _torch_output(s, where):
    return PrepareModuleOutput(output_layouts=s.output_layouts,
                               desired_output_layouts=s.desired_output_layouts,
                               use_local_output=s.use_local_output)


# PyTorch's class -> (ours from it, the attributes it may carry, each attribute that has only
# one value we carry out -> (that value, why)). `src_data_rank` (which rank's full weight is split)
# may take any value: every rank here splits its own, and the ranks are checked to agree.
# RowwiseParallel's desired_input_layouts is set by PyTorch itself from the module's kind.
_FROM_TORCH = {
    torch_tp.ColwiseParallel: (_torch_colwise, {"input_layouts", "output_layouts",
                                                "desired_input_layouts", "use_local_output"},
                               {"desired_input_layouts": (
                                   (Replicate(),), "the column GEMM takes the whole input; "
                                                   "input_layouts says how it arrives")}),
    torch_tp.RowwiseParallel: (_torch_rowwise, {"input_layouts", "output_layouts",
                                                "desired_input_layouts", "use_local_output"}, {}),
    torch_tp.SequenceParallel: (_torch_sequence, {"sequence_sharding", "use_local_output"}, {}),
    torch_tp.PrepareModuleInput: (_torch_input, {"input_layouts", "desired_input_layouts",
                                                 "input_kwarg_layouts", "with_kwargs",
                                                 "desired_input_kwarg_layouts",
                                                 "use_local_output"}, {}),
    torch_tp.PrepareModuleOutput: (_torch_output, {"output_layouts", "desired_output_layouts",
                                                   "use_local_output"}, {}),
}


def is_style(value):
    """Whether `value` is a style, ours or PyTorch's (a plan may be one style, for the module
    it is given with)."""
    return isinstance(value, STYLES + (torch_tp.ParallelStyle,))


def translate_style(style, where):
    """The style of ours that carries out `style`: one of ours as it is; PyTorch's own
    (`torch.distributed.tensor.parallel.ColwiseParallel(...)` etc.) as ours of the same name
    with the same arguments, read from its attributes. Anything else, or an attribute of
    PyTorch's that we would not carry out, is refused in one line naming it (`where`: the plan
    entry)."""
    if isinstance(style, STYLES):
        return style
    cls = type(style)
    valid = ", ".join(s.__name__ for s in STYLES)
    if cls not in _FROM_TORCH:
        kind = ("a PyTorch style this package does not carry out"
                if isinstance(style, torch_tp.ParallelStyle) else "not a style")
        raise ValueError(f"{where} is a {cls.__module__}.{cls.__name__} ({kind}): valid are "
                         f"{valid}, ours or torch.distributed.tensor.parallel's")
    ours, known, only = _FROM_TORCH[cls]
    for attr, value in vars(style).items():
        if attr == "src_data_rank":
            continue
        if attr not in known:
            raise ValueError(f"{where}: PyTorch's {cls.__name__} carries {attr}={value!r}, "
                             f"which this package does not carry out; valid are "
                             f"{', '.join(sorted(known))}")
        if attr in only and value != only[attr][0]:
            raise ValueError(f"{where}: PyTorch's {cls.__name__} with {attr}={value!r}: valid "
                             f"is {only[attr][0]!r} ({only[attr][1]})")
    return ours(style, where)


# ----------------------------------------------------------------------------------------------
# A plan of ours in PyTorch's classes
# ----------------------------------------------------------------------------------------------
def torch_plan(plan):
    """`plan` with each style replaced by PyTorch's class of the same name and arguments, for
    `torch.distributed.tensor.parallel.parallelize_module`. PyTorch has no output_shape: a
    ColwiseParallel with one splits the rows contiguously there, which equals ours only on a
    weight whose rows were laid out rank by rank first (`rank_major_rows`). SequenceParallel
    returns a local tensor there too (use_local_output=True), as ours does; NoParallel entries
    are left out (PyTorch keeps such a module as it is). NormOverSplit has no PyTorch class:
    refused in one line."""
    out = {}
    for key, style in plan.items():
        if isinstance(style, NormOverSplit):
            raise ValueError(f"plan[{key!r}] is NormOverSplit(), which PyTorch's styles cannot "
                             f"say (its plans gather the projection before such a norm); "
                             f"torch_plan takes the styles PyTorch has")
        if isinstance(style, ColwiseParallel):
            out[key] = torch_tp.ColwiseParallel(input_layouts=style.input_layouts,
                                          output_layouts=style.output_layouts,
                                          use_local_output=style.use_local_output)
        elif isinstance(style, RowwiseParallel):
            out[key] = torch_tp.RowwiseParallel(input_layouts=style.input_layouts,
                                          output_layouts=style.output_layouts,
                                          use_local_output=style.use_local_output)
        elif isinstance(style, SequenceParallel):
            out[key] = torch_tp.SequenceParallel(sequence_dim=style.sequence_dim,
                                                 use_local_output=True)
        elif isinstance(style, PrepareModuleInput):
            out[key] = torch_tp.PrepareModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts,
                use_local_output=style.use_local_output)
        elif isinstance(style, PrepareModuleOutput):
            out[key] = torch_tp.PrepareModuleOutput(
                output_layouts=style.output_layouts,
                desired_output_layouts=style.desired_output_layouts,
                use_local_output=style.use_local_output)
    return out


def block_rows(sizes, p):
    """The `RowSplit` of a weight whose rows are blocks of `sizes` side by side (a fused q|k|v
    with fewer k/v heads than query heads: (q, k, v) rows), each block cut into p contiguous
    pieces: rank r holds piece r of every block, in block order, so its output is its own q, k
    and v side by side, as the full output is (a block of equal sizes is output_shape's (n, m)
    split along m)."""
    starts = torch.tensor((0,) + tuple(sizes)).cumsum(0)[:-1]
    return RowSplit(torch.stack([
        torch.cat([start + torch.arange(size).chunk(p)[r] for start, size in zip(starts, sizes)])
        for r in range(p)]))


def column_rows(style, p):
    """The `RowSplit` a ColwiseParallel's output_shape or output_sizes gives (None: one block
    of rows per rank)."""
    if style.output_sizes is not None:
        return block_rows(tuple(style.output_sizes), p)
    if style.output_shape is not None:
        return split_rows(tuple(style.output_shape), style.split_dim, p)
    return None


def rank_major_rows(style, p):
    """The order of a full weight's rows under which PyTorch's contiguous row split gives rank r
    exactly the rows `style` (a ColwiseParallel with output_shape or output_sizes) gives it
    here: `w[order]` for PyTorch, and `grad[order.argsort()]` back. None (the identity)
    without either."""
    rows = column_rows(style, p)
    return None if rows is None else rows.rows.flatten()


# ----------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------
def layout_or(value, default):
    """A style's layout, or `default` when it gives none; a one-element tuple is its element."""
    value = default if value is None else value
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    return value


def sequence_dim(layout, what, where):
    """The sequence dim a layout names: Shard(d) -> d, Replicate() -> None."""
    if isinstance(layout, Replicate):
        return None
    if isinstance(layout, Shard):
        return layout.dim
    raise ValueError(f"{where}: {what}={layout!r}: valid are Shard(d) (the sequence split along "
                     f"dim d) and Replicate()")


def layout_pairs(have, want, where):
    """The layouts as two equally long tuples, each pair one the functions above move between."""
    have = have if isinstance(have, (tuple, list)) else (have,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    if len(have) != len(want):
        raise ValueError(f"{where}: {len(have)} layouts given, {len(want)} desired; give one "
                         f"per input (None where it is not a tensor)")
    for a, b in zip(have, want):
        if (a is None) != (b is None) or not (a == b or {type(a), type(b)} == {Shard, Replicate}
                                              or a is None):
            raise ValueError(f"{where}: {a!r} -> {b!r}: valid moves are Shard(d) -> Replicate() "
                             f"(all-gather) and Replicate() -> Shard(d) (this rank's slice)")
    return tuple(have), tuple(want)


def prepare_hook(style, group, where):
    """The hook functions of a PrepareModuleInput / PrepareModuleOutput."""
    if isinstance(style, PrepareModuleOutput):
        have, want = layout_pairs(style.output_layouts, style.desired_output_layouts, where)

        def output_hook(module, args, output):
            single = not isinstance(output, tuple)
            moved = tuple(redistribute(x, a, b, group, where)
                          for x, a, b in zip((output,) if single else output, have, want))
            return moved[0] if single else moved
        return output_hook
    have, want = layout_pairs(style.input_layouts, style.desired_input_layouts, where)
    kw_have = style.input_kwarg_layouts or {}
    kw_want = style.desired_input_kwarg_layouts or {}
    layout_pairs(tuple(kw_have.get(k) for k in kw_want), tuple(kw_want.values()), where)

    def input_hook(module, args, kwargs):
        args = tuple(redistribute(x, a, b, group, where) for x, a, b in zip(args, have, want)) \
            + tuple(args[len(have):])
        kwargs = {k: redistribute(v, kw_have.get(k), kw_want.get(k), group, where)
                  for k, v in kwargs.items()}
        return args, kwargs
    return input_hook
