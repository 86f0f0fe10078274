"""The styles of a plan (apply/plan.py): what a plan says about one module, in PyTorch's
names and arguments, and the layout helpers that read them (which dim a `Shard(d)` names, the
moves a PrepareModuleInput / Output may make, and the hooks that make them)."""
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard

from .layers import redistribute


# ----------------------------------------------------------------------------------------------
# The styles: what a plan says about one module
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ColwiseParallel:
    """An nn.Linear's output features split over the ranks (PlannedColumn)."""
    input_layouts: object = None  # None: Replicate()
    output_layouts: object = None  # None: Shard(-1)
    use_local_output: bool = True  # accepted for PyTorch's sake: our outputs are plain tensors
    output_shape: tuple = None  # the rows flatten this shape (a fused projection)
    split_dim: int = 0  # the dim of output_shape split over the ranks


@dataclass(frozen=True)
class RowwiseParallel:
    """An nn.Linear's input features (or an nn.Embedding's rows) split (PlannedRow / Embedding)."""
    input_layouts: object = None  # None: Shard(-1)
    output_layouts: object = None  # None: Replicate()
    use_local_output: bool = True


@dataclass(frozen=True)
class SequenceParallel:
    """A module on this rank's part of dim `sequence_dim`, its parameters whole, their
    gradients summed over the group; a dropout's mask one device's."""
    sequence_dim: int = 1
    use_local_output: bool = False


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


STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel, NoParallel, PrepareModuleInput,
          PrepareModuleOutput)


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
