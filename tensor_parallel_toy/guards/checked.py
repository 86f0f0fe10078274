"""The guards attached to the reading path: the checked layers, loss and model.

The layers in parallel_linear.py and vocab_parallel.py and the `Transformer` in model.py hold
the idea and no checks. What makes a distributed run trustworthy is attached here, from outside:

- `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding` (what the package top
  exports): the reading path's layers, whose ranks compare a fingerprint of what they built
  (agreement.py: one tiny all-gather), so a rank that built another layer raises on every rank
  instead of computing with mismatched shards; the embedding also checks its token ids (a
  forward pre-hook).
- `vocab_parallel_cross_entropy` (exported too): the reading path's loss after the checks
  F.cross_entropy would make: label shape, loss options, labels in range.
- `with_guards`, the one line above `class Transformer`: the model's options checked and its
  TP size against the config before anything is built; after it is built, the ranks compare
  the model's fingerprint; every call's batch checked before any collective of the forward
  (batch.py, a forward pre-hook); the replicated-gradient watch when asked (replicated_grads.py).
"""
import dataclasses
import inspect
import zlib

from .. import parallel_linear, vocab_parallel
from ..comm import group_size
from ..support.sharding import tensor_parallel_rows
from .agreement import check_ranks_agree, check_same_batch_option, module_fingerprint
from .batch import check_batch, check_loss_options, check_token_ids
from .replicated_grads import check_every_option, watch_replicated_gradients


def check_overlap_option(overlap):
    """overlap: False (whole collectives), True (the ring) or m >= 1 (the ring, each chunk cut
    into m pieces); anything else is refused in one line."""
    if isinstance(overlap, bool) or (isinstance(overlap, int) and overlap >= 1):
        return
    raise ValueError(f"overlap={overlap!r}: valid are False (whole collectives), True (the "
                     f"ring) or a number of ring pieces m >= 1")


def _agree_on_layer(layer, **fields):
    """The ranks of the layer's group compare its fingerprint; one line on every rank if not."""
    name = type(layer).__name__
    check_ranks_agree(module_fingerprint(layer, layer=name, tp_size=group_size(layer.tp_group),
                                         **fields),
                      layer.tp_group, f"{name}s")


class ColumnParallelLinear(parallel_linear.ColumnParallelLinear):
    """parallel_linear.ColumnParallelLinear, whose ranks compare what they built (one tiny
    all-gather when it is built; a rank that built another layer raises on every rank)."""

    def __init__(self, in_features, out_features, **kwargs):
        check_overlap_option(kwargs.get("overlap", False))
        super().__init__(in_features, out_features, **kwargs)
        split = tensor_parallel_rows(self.weight)  # ranks may hold the same shape's other rows
        _agree_on_layer(self, in_features=in_features, out_features=out_features,
                        overlap=self.overlap,
                        split=None if split is None else zlib.crc32(split.rows.numpy().tobytes()))


class RowParallelLinear(parallel_linear.RowParallelLinear):
    """parallel_linear.RowParallelLinear, whose ranks compare what they built (as
    ColumnParallelLinear's)."""

    def __init__(self, in_features, out_features, **kwargs):
        check_overlap_option(kwargs.get("overlap", False))
        super().__init__(in_features, out_features, **kwargs)
        _agree_on_layer(self, in_features=in_features, out_features=out_features,
                        overlap=self.overlap, split=None)


class VocabParallelEmbedding(vocab_parallel.VocabParallelEmbedding):
    """vocab_parallel.VocabParallelEmbedding, whose ranks compare what they built, and whose
    every call checks its token ids first (`check_ids`: see batch.check_token_ids; None, the
    default: a CPU tensor always, a GPU tensor never)."""

    def __init__(self, num_embeddings, embedding_dim, *, tp_group, check_ids=None, **kwargs):
        super().__init__(num_embeddings, embedding_dim, tp_group=tp_group, **kwargs)
        self.check_ids = check_ids
        _agree_on_layer(self, num_embeddings=num_embeddings, embedding_dim=embedding_dim,
                        check_ids=check_ids)
        self.register_forward_pre_hook(
            lambda module, args: check_token_ids(args[0], num_embeddings, "token id",
                                                 check_ids=check_ids))


def vocab_parallel_cross_entropy(logits_local, labels, tp_group, *, ignore_index=-100,
                                 label_smoothing=0.0, reduction="mean", check_ids=None):
    """vocab_parallel.vocab_parallel_cross_entropy, after the checks F.cross_entropy would
    make: labels shaped like the logits without their last dim, the loss options, every label
    in the vocabulary or ignore_index (`check_ids` says when: see batch.check_token_ids)."""
    if labels.shape != logits_local.shape[:-1]:
        raise ValueError(f"labels of shape {list(labels.shape)} do not match logits of shape "
                         f"{list(logits_local.shape)} (expected {list(logits_local.shape[:-1])})")
    check_loss_options(label_smoothing, reduction)
    check_token_ids(labels, logits_local.shape[-1] * group_size(tp_group), "label", ignore_index,
                    check_ids)
    return vocab_parallel.vocab_parallel_cross_entropy(
        logits_local, labels, tp_group, ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction=reduction)


def with_guards(transformer_class):
    """Class decorator of model.Transformer: its guards, and the three options that set them.

    `check_ids` (None, the default: when the batch is on the CPU, which is free; True: also on
    a GPU, one device-to-host copy per checked tensor; False: never): token ids and labels in
    the vocabulary. `same_batch` ("check", the default: a checksum of ids and labels compared
    over the TP group, a difference raises on every rank; "broadcast": TP rank 0's batch copied
    into the other ranks' tensors, which must have its shape). `check_replicated_grads`
    ("first", or N for every N-th backward; None, the default: off): every replicated
    parameter's gradient compared over the TP group at the end of a backward
    (replicated_grads.py: 40 bytes per parameter).

    Construction ends with the ranks comparing a fingerprint of what they built (config, TP
    size, overlap, seed, these options, every parameter's shape and dtype): ranks that built
    different models raise on every rank, naming the fields that differ.
    """
    build = transformer_class.__init__
    forward_arguments = inspect.signature(transformer_class.forward)

    def check_each_batch(model, args, kwargs):
        call = forward_arguments.bind(model, *args, **kwargs)
        call.apply_defaults()
        arguments = dict(call.arguments)
        del arguments["self"]
        check_batch(model, **arguments)

    def __init__(self, config, tp_group=None, overlap=False, *, seed=0, check_ids=None,
                 same_batch="check", check_replicated_grads=None):
        config.check_tp_size(group_size(tp_group))  # before any layer is built
        check_overlap_option(overlap)
        check_same_batch_option(same_batch)
        check_every_option(check_replicated_grads)
        build(self, config, tp_group, overlap, seed=seed)
        self.check_ids, self.same_batch = check_ids, same_batch
        fingerprint = module_fingerprint(
            self, **dataclasses.asdict(config), tp_size=group_size(tp_group), overlap=overlap,
            seed=seed, check_ids=check_ids, same_batch=same_batch,
            check_replicated_grads=check_replicated_grads)
        check_ranks_agree(fingerprint, tp_group, "Transformers")  # one tiny all-gather
        self.register_forward_pre_hook(check_each_batch, with_kwargs=True)
        self.replicated_grads_watch = watch_replicated_gradients(self, tp_group,
                                                                 check_replicated_grads)

    __init__.__qualname__ = f"{transformer_class.__qualname__}.__init__"
    transformer_class.__init__ = __init__
    return transformer_class
