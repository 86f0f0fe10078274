"""`guard(model)`: the checks that make a distributed run trustworthy, attached from outside.

Every door into the package ends here, with the same checks made by the same code:

    model = guard(Transformer(config, tp_group=g))     # the package's model: at the call site
    parallelize_module(model, g, plan)                 # a plan: the same checks at its end
    apply_tensor_parallel(model, g)                    # classic TP: a plan, so the same

What `guard` does (each rank; every check raises the same one-line error on every rank):

1. Now, once: the ranks compare a fingerprint of what they hold (the config and seed where the
   model has them, the TP size, every parameter's name, shape and dtype, the values of every
   parameter no rank splits): one tiny all-gather. Ranks that built or loaded different
   models are refused here, not by a hang in the first collective.
2. Every call of the model, before its forward's first collective: the integer and bool
   tensors it is called with (token ids, labels, positions, masks) are compared over the
   group (`same_batch="check"`: a checksum, one all-gather of 6 int64s per tensor and one
   host read of the verdict) or replaced by TP rank 0's (`"broadcast"`). Ranks fed different
   batches would each return a loss of no batch at all. Only the outermost guarded module
   checks (a block guarded inside a guarded model adds nothing).
3. Every call of a vocabulary-parallel embedding: its ids in 0..vocab-1 (`check_ids`; None,
   the default: when the ids are on the CPU, which is free; True: also on a GPU, one
   device-to-host read per call; False: never). One device raises IndexError on such an id;
   a vocabulary split over ranks would embed it as zeros. The package's `Transformer` also
   gets its batch's shape, length, labels and loss options checked (batch.py).
4. At the end of the first backward (`check_replicated_grads="first"`, the default; N: every
   N-th; None: off): every parameter no rank splits must have the same gradient on every rank
   (replicated_grads.py: 40 bytes per parameter, once). A norm whose gradient is a partial sum
   (it sees sequence shards, not the same data) would otherwise train silently wrong.

`guard` returns the model; `model.guards` holds what it attached (`.remove()` turns it all
off). Guarding a model again replaces its guards. A group of one rank (or None) needs none of
this: `guard` only checks the options then.
"""
import contextvars
import dataclasses
import inspect
import zlib

import torch
from torch.distributed.tensor import DTensor

from ..comm import group_size
from ..config import check_overlap_option
from ..model import Transformer
from ..parallel_linear import ColumnParallelLinear, RowParallelLinear
from ..vocab_parallel import VocabParallelEmbedding
from .agreement import (agree_on_batch, check_ranks_agree, check_same_batch_option,
                        module_fingerprint)
from .batch import check_batch, check_token_ids
from ..support.sharding import named_layouts
from .replicated_grads import check_every_option, watch_replicated_gradients

# Set while a guarded module's forward runs, so that a guarded module called inside it (a
# block planned in a later call) leaves the batch to the outermost one. A context variable:
# each thread (and each task) has its own.
_INSIDE_GUARDED_FORWARD = contextvars.ContextVar("inside_guarded_forward", default=False)


@dataclasses.dataclass
class Guards:
    """What `guard` attached to a model: its options, hook handles and the gradient watch."""
    tp_group: object
    check_ids: object
    same_batch: str
    check_replicated_grads: object
    handles: list
    replicated_grads_watch: object = None

    def remove(self):
        """Detach every check (the model then runs unchecked)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.replicated_grads_watch is not None:
            self.replicated_grads_watch.remove()


def _integer_tensors(args, kwargs, names):
    """{name: tensor} of the call's integer and bool tensors: what a batch is made of."""
    named = {**{names[i] if i < len(names) else f"argument {i}": v for i, v in enumerate(args)},
             **kwargs}
    return {name: v for name, v in named.items() if isinstance(v, torch.Tensor)
            and not (v.is_floating_point() or v.is_complex())}


def _fingerprint(model, tp_group, options):
    fields = dict(options, tp_size=group_size(tp_group), overlap=getattr(model, "overlap", None),
                  sequence_parallel=getattr(model, "sequence_parallel", None),
                  seed=getattr(model, "seed", None))
    pieces = {m.ring_pieces for m in model.modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    if pieces:  # ranks whose rings are cut differently would post different transfers
        fields["ring_pieces"] = sorted(pieces)
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config):
        fields.update({f"config.{k}": v for k, v in dataclasses.asdict(config).items()})
    for name, param, layout in named_layouts(model):
        split = layout.rows
        if split is not None:  # ranks may hold the same shape's other rows
            fields[f"split:{name}"] = zlib.crc32(split.rows.numpy().tobytes())
        if layout.dim is None and \
                not isinstance(param, DTensor):  # the same on every rank (DTensor: its own)
            fields[f"sum:{name}"] = repr(param.detach().double().sum().item())
    return module_fingerprint(model, **fields)


def guard(model, tp_group=None, *, check_ids=None, same_batch="check",
          check_replicated_grads="first"):
    """Attach the checks above to `model` (any nn.Module split over `tp_group`; by default the
    model's own `tp_group`) and return it. Every rank of the group must call it alike."""
    options = guard_options(check_ids=check_ids, same_batch=same_batch,
                            check_replicated_grads=check_replicated_grads)
    for module in model.modules():  # the package's layers, and the Transformer
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            check_overlap_option(module.overlap, module.ring_pieces)
        elif isinstance(module, Transformer):
            check_overlap_option(module.overlap)
    own = getattr(model, "tp_group", None)
    if tp_group is None:
        tp_group = own
    elif own is not None and own is not tp_group:
        raise ValueError("guard(model, tp_group): the model was built over another group; "
                         "leave tp_group out to use the model's own")
    if group_size(tp_group) > 1:
        check_ranks_agree(_fingerprint(model, tp_group, options), tp_group,
                          f"{type(model).__name__}s")  # one tiny all-gather
    return attach_guards(model, tp_group, options)


def guard_options(*, check_ids, same_batch, check_replicated_grads):
    """`guard`'s options, each checked (one line naming a bad value), as a dict; a door that
    splits a model itself checks them before it starts (parallelize_module)."""
    check_same_batch_option(same_batch)
    check_every_option(check_replicated_grads)
    if check_ids not in (None, True, False):
        raise ValueError(f"check_ids={check_ids!r}: valid are None (on the CPU only), True, "
                         f"False")
    return dict(check_ids=check_ids, same_batch=same_batch,
                check_replicated_grads=check_replicated_grads)


def attach_guards(model, tp_group, options):
    """The checks themselves, attached (steps 2 to 4 above), once the ranks have compared what
    they hold: `guard` compares the model as it is; a door that splits a model compares it,
    with the plan and the options, before the split (parallelize_module), and not again."""
    if getattr(model, "guards", None) is not None:
        model.guards.remove()
    check_ids, same_batch = options["check_ids"], options["same_batch"]
    check_replicated_grads = options["check_replicated_grads"]
    model.guards = Guards(tp_group, handles=[], **options)
    if group_size(tp_group) == 1:
        return model
    model.guards.handles += _attach_batch_check(model, tp_group, check_ids, same_batch)
    # The package's Transformer checks its ids with the rest of its batch (batch.py). Any other
    # model: each embedding, split by us (VocabParallelEmbedding), by DTensor or not at all.
    for module in ([] if isinstance(model, Transformer) else model.modules()):
        if isinstance(module, (VocabParallelEmbedding, torch.nn.Embedding)):
            model.guards.handles.append(module.register_forward_pre_hook(
                _ids_check(module.num_embeddings, check_ids)))
    model.guards.replicated_grads_watch = watch_replicated_gradients(model, tp_group,
                                                                     check_replicated_grads)
    return model


def _ids_check(vocab_size, check_ids):
    def check(module, args):
        check_token_ids(args[0], vocab_size, "token id", check_ids=check_ids)
    return check


def _attach_batch_check(model, tp_group, check_ids, same_batch):
    """The forward hooks of check 2 (with the package Transformer's own batch check)."""
    names = _positional_names(model)
    entered = []  # a token per forward of this module in progress; None: not the outermost

    def before(module, args, kwargs):
        if _INSIDE_GUARDED_FORWARD.get():
            entered.append(None)
            return
        entered.append(_INSIDE_GUARDED_FORWARD.set(True))
        try:
            if isinstance(module, Transformer):
                check_batch(module, tp_group, *args, check_ids=check_ids,
                            same_batch=same_batch, **kwargs)
            elif batch := _integer_tensors(args, kwargs, names):  # a float input: a block
                agree_on_batch(batch, tp_group, same_batch)
        except BaseException:
            _INSIDE_GUARDED_FORWARD.reset(entered.pop())
            raise

    def after(module, args, kwargs, output):
        if entered:
            token = entered.pop()
            if token is not None:
                _INSIDE_GUARDED_FORWARD.reset(token)

    return [model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True, always_call=True)]


def _positional_names(model):
    """The names of `model.forward`'s positional parameters (for error messages)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
