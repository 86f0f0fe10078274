"""A `SequenceParallel` module's parameters: their partial gradients summed over the TP group by
a hook on each Parameter, and the check that the hooks are still there.

A module a plan keeps whole but runs on this rank's part of the data (a LayerNorm on its s/p
tokens) gets a partial gradient on each rank; `f`'s backward, an all-reduce, makes it the whole
one. model.py's norms call `f` in their forward; a plan cannot rewrite an arbitrary module's
forward, so it registers the all-reduce as a hook on each Parameter. A hook lives on the
Parameter object: whatever replaces the object (FSDP2's `fully_shard` does, for every
parameter of the modules it wraps) leaves the new one without it, and each rank would then
step with its own partial gradient, silently. So every forward of a module the plan split
first checks, on the host, that each hooked Parameter is still the one its module holds, and
refuses in one line, on every rank alike, before the model computes (an engine's own hooks,
FSDP2's weight all-gather, may run before it), when one is not.
"""
import weakref

from ..comm import all_reduce_


def _sum_over(group):
    # f's backward at the leaf: this backward's partial gradient summed over the group.
    return lambda grad: all_reduce_(grad.clone(), group)


def hook_partial_sums(mod, group):
    """Sum the gradient of every parameter of `mod` over `group`, and remember where each hooked
    Parameter sits, (its module, attribute, the object held weakly: one replaced and freed
    reads as gone)."""
    mod.summed_parameters = {}
    for sub_name, sub in mod.named_modules():
        for attr, param in sub.named_parameters(recurse=False):
            param.register_hook(_sum_over(group))
            label = ".".join(n for n in (sub_name, attr) if n)
            mod.summed_parameters[label] = (sub, attr, weakref.ref(param))


def watch_sums(module):
    """Check at every forward of `module` that the hooked Parameters of the modules in it are
    still theirs (`check_sums_in_place`). Nested calls keep one watch: the outermost module's
    runs first and, at its first run, removes those of the modules inside it."""
    def check(mod, args):
        if "summed_index" not in mod.__dict__:  # the first run: the plan's calls all made
            for sub in list(mod.modules())[1:]:
                inner = sub.__dict__.pop("sums_watch", None)
                if inner is not None:
                    inner.remove()
        check_sums_in_place(mod)

    module.sums_watch = module.register_forward_pre_hook(check)


def check_sums_in_place(root):
    """Raise ValueError (one line) if a parameter whose gradient the plan sums by a hook is no
    longer the Parameter that carries the hook."""
    index = root.__dict__.get("summed_index")
    if index is None:  # where to look, found once
        index = root.__dict__["summed_index"] = [
            (".".join(n for n in (name, label) if n), *where)
            for name, mod in root.named_modules()
            for label, where in getattr(mod, "summed_parameters", {}).items()]
    for label, owner, attr, hooked in index:
        if getattr(owner, attr, None) is not hooked():
            raise ValueError(
                f"{label} is no longer the Parameter parallelize_module hooked to sum its "
                f"gradient over the tensor-parallel group (replaced after the split, as "
                f"fully_shard does): each rank would step with its partial gradient; wrap a "
                f"plan's model in DDP, which keeps the Parameters, or use the package's "
                f"Transformer with apply_fsdp")
