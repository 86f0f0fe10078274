"""A `SequenceParallel` module's parameters: their gradients summed over the TP group in the
graph, by `f`, as the package's own norms sum theirs.

A module a plan keeps whole but runs on this rank's part of the data (a LayerNorm on its s/p
tokens) gets a partial gradient on each rank; the true gradient is the sum over the group.
model.py's norms put their weight through `f` (forward identity, backward all-reduce) in their
own forward. A plan cannot rewrite an arbitrary module's forward, so it does the same from
outside: for the length of each of the module's forwards, each of its parameters is replaced
by `f` of itself, and put back after (also when the forward raises).

    forward of a SequenceParallel LayerNorm:   weight -> f(weight) -> layer_norm(x, f(weight))
    backward:                                  the partial gradient, all-reduced, into weight

The sum is then a node of the autograd graph, not a hook on the Parameter object: an engine
that replaces the Parameters (FSDP2's `fully_shard` swaps every one, and puts its unsharded
ones in place for each forward) finds nothing to lose, since the swap reads whatever Parameter
the module holds when its forward starts; DDP's reduction and gradient accumulation see the
summed gradient, each backward summing only its own contribution.
"""
from ..comm import copy_to_tensor_parallel_region


def sum_gradients_in_graph(module, group):
    """From now on, every forward of `module` runs with each of its parameters (its
    submodules' too) through `f` over `group`. Returns the two hook handles."""
    held = []  # per running forward: [(owner module, name, the Parameter put back after)]

    def through_f(mod, args):
        swapped = []
        for owner in mod.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None:
                    swapped.append((owner, name, param))
                    # Into the dict itself: nn.Module's setattr accepts only Parameters there.
                    owner._parameters[name] = copy_to_tensor_parallel_region(param, group)
        held.append(swapped)

    def put_back(mod, args, output):
        for owner, name, param in held.pop():
            owner._parameters[name] = param

    return (module.register_forward_pre_hook(through_f),
            module.register_forward_hook(put_back, always_call=True))
