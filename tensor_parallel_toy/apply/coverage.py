"""What a whole plan must cover, checked at the first forward: every parallelize_module call on
a model and its parts made by then (a plan may come in several calls, as PyTorch allows).

Every parameter is split by a style or kept whole by one; a weight tied to a split one is split
the same way; every nn.Dropout with p > 0 has an entry (which region it runs in is not visible
from the model). Each reads the style a call left on the modules it planned (`plan_style`) and
raises one line for the first problem.
"""
import torch.nn as nn

from .styles import ColwiseParallel, NoParallel, NormOverSplit, RowwiseParallel, SequenceParallel

SPLITTING = (ColwiseParallel, RowwiseParallel, NormOverSplit)  # the styles that split weights


def _check_covered(module, matched):
    """Every parameter must be split by a style or kept whole by one (named per module)."""
    whole = [name for name, (_, style) in matched.items()
             if isinstance(style, (SequenceParallel, NoParallel))]
    split = [name for name, (_, style) in matched.items()
             if isinstance(style, SPLITTING)]
    own_only = set()  # NoParallel beside split layers: it keeps whole its own parameters only
    for w in whole:
        inner = [n for n in split if w == "" or n.startswith(w + ".")]
        if inner and isinstance(matched[w][1], NoParallel):
            own_only.add(w)  # it does nothing to a parameter, so it cannot reach the split ones
        elif inner:  # its gradient sum (or none) would reach the split weights too
            raise ValueError(f"{type(matched[w][1]).__name__} at {w!r} holds {inner[0]!r}, "
                             f"which the plan splits; give the whole-weight style to the "
                             f"modules that hold whole weights only")
    for name, mod in module.named_modules():
        own = [n for n, _ in mod.named_parameters(recurse=False)]
        if not own:
            continue
        style = matched.get(name, (None, None))[1]
        if isinstance(style, SPLITTING):
            continue
        if any(name == w or (w not in own_only and (w == "" or name.startswith(w + ".")))
               for w in whole):
            continue
        label = f"{name}.{own[0]}" if name else own[0]
        raise ValueError(
            f"parameter {label!r} ({type(mod).__name__} at {name!r}) is neither split nor kept "
            f"whole by the plan: it would stay a per-rank tensor with a partial gradient; give "
            f"{name!r} a ColwiseParallel / RowwiseParallel entry, SequenceParallel if it acts on "
            f"this rank's rows, or NoParallel if it sees the same data on every rank")


def _check_dropouts(module, matched):
    for name, mod in module.named_modules():
        if isinstance(mod, nn.Dropout) and mod.p > 0 and name not in matched:
            raise ValueError(f"nn.Dropout at {name!r} (p={mod.p}) has no plan entry: give it "
                             f"SequenceParallel(sequence_dim=d), d the dim split over the ranks "
                             f"(one device's mask), or NoParallel() if it acts between a split "
                             f"column layer and its row layer (this rank's own random stream) or "
                             f"on the same data on every rank")


def _check_ties(module, matched):
    """A weight tied to one the plan splits must be split the same way (then it is the same
    Parameter again, `_copy_shards`); the full weight left behind names its split twin."""
    for name, mod in module.named_modules():
        if isinstance(matched.get(name, (None, None))[1], SPLITTING):
            continue
        for pname, param in mod.named_parameters(recurse=False):
            twin = getattr(param, "split_into", None)
            if twin is not None:
                label = f"{name}.{pname}" if name else pname
                raise ValueError(f"{label} is tied to {twin[1]}, which the plan splits, but "
                                 f"{name!r} is not split the same way; plan it too")


def check_plan_coverage(module):
    """The checks that need the whole plan, every parallelize_module call on `module` and its
    parts made: every parameter split or kept whole, no tied weight split on one side only, no
    unplanned dropout with p > 0. Reads the style each call left on the modules it planned
    (`plan_style`); one line for the first problem. Runs by itself at the first forward."""
    matched = {name: (mod, mod.plan_style) for name, mod in module.named_modules()
               if getattr(mod, "plan_style", None) is not None}
    _check_ties(module, matched)
    _check_covered(module, matched)
    _check_dropouts(module, matched)


def check_at_first_forward(module):
    """`check_plan_coverage` in a forward pre-hook of `module`, run once it passes. The
    outermost planned module's hook runs first and removes those of the modules inside it."""
    def check(mod, args):
        check_plan_coverage(mod)
        for sub in mod.modules():
            pending = sub.__dict__.pop("pending_plan_check", None)
            if pending is not None:
                pending.remove()

    earlier = module.__dict__.pop("pending_plan_check", None)
    if earlier is not None:
        earlier.remove()
    module.pending_plan_check = module.register_forward_pre_hook(check)
