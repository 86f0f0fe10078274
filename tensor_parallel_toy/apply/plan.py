"""A plan in PyTorch's words, carried out by this package's layers: TP + SP (+ overlap) for a
model of your own.

    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "transformer.h.*.ln_*": SequenceParallel(),
        "transformer.h.*.attn.c_attn": ColwiseParallel(input_layouts=Shard(1),
                                                       output_shape=(3, n_head, head_dim),
                                                       split_dim=1),
        "transformer.h.*.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        ...
    }
    parallelize_module(model, tp_group, plan, overlap=True)

The styles have the names, arguments and meaning of `torch.distributed.tensor.parallel`'s
(`Shard(d)` / `Replicate()` are PyTorch's placements; `Shard(d)` on an activation says which
dim holds the sequence, split over the ranks), and PyTorch's own objects are taken too, read
into ours with the same arguments (styles.translate_style). A plan written for PyTorch runs as
written: one style for the module it is given with, or a plan in several calls (the root's
entries, then each block's, as PyTorch's own test Transformer.parallelize does):

    parallelize_module(model, tp_group, {"tok_embeddings": RowwiseParallel(...), ...})
    for block in model.layers:
        parallelize_module(block, tp_group, {"attention.wq": ColwiseParallel(), ...})
    parallelize_module(model.output, tp_group, ColwiseParallel(output_layouts=Replicate()))

A module a call is given and a style replaces (an nn.Linear made a column layer) is changed in
place, its class and weights, as PyTorch changes it; a weight tied to one split in an earlier
call is split the same way and becomes the same Parameter again. Whether the plan covers every
parameter is known only once every call is made: it is checked at the first forward of the
outermost planned module (a one-shot pre-hook, check_plan_coverage).

What each style does here, p = TP size:

    ColwiseParallel   nn.Linear -> ColumnParallelLinear, weight rows split.
                      input Shard(d): all-gather the sequence, then the GEMM (parallel_linear's
                      _AllGatherGemm, or its ring with overlap=True); backward reduce-scatter.
                      input Replicate() (the default): `f` (copy_to_tensor_parallel_region).
                      output Shard(-1) (default): this rank's features; Replicate(): gathered
                      (gather_from_tensor_parallel_region; backward keeps this rank's slice),
                      and then out_features may be any size (an LM head over any vocabulary:
                      padded to a multiple of p, the gathered padding dropped).
                      output_shape=(...), split_dim=k: the rows flatten that shape, split along
                      dim k (a fused q|k|v is (3, heads, head_dim) split along 1).
                      output_sizes=(a, b, ...): the rows are blocks of those sizes, each cut
                      in p pieces, rank r holding piece r of each (a fused q|k|v with fewer k/v
                      heads: (heads * hd, kv_heads * hd, kv_heads * hd)).
                      A 1x1 nn.Conv2d (channels on dim 1) -> PlannedConvColumn, default
                      layouts only: `f`, then its output channels (classic TP).
    RowwiseParallel   nn.Linear -> RowParallelLinear, weight columns split, bias replicated.
                      output Shard(d): GEMM then reduce-scatter the sequence (_GemmReduceScatter
                      or its ring); output Replicate() (default): `g`, an all-reduce.
                      nn.Embedding -> VocabParallelEmbedding: rows split (any num_embeddings:
                      padded to a multiple of p, vocab_parallel.py), the whole ids in
                      (input Replicate()); output Shard(d): reduce-scatter the sequence
                      (reduce_scatter_to_sequence_parallel_region); Replicate(): `g`.
                      A 1x1 nn.Conv2d -> PlannedConvRow: its input channels, then `g`.
    SequenceParallel  a module applied to this rank's rows (d = sequence_dim, default 1): its
                      parameters stay whole and their gradient is summed over the group in the
                      graph: each forward runs with them through `f` (sequence_parallel.py),
                      as model.py's norms run theirs, so fully_shard and DDP keep the sum. An
                      nn.Dropout draws one device's whole mask and keeps this rank's slice.
    NormOverSplit     an RMSNorm over a column layer's split output (OLMo 2's q/k norm over
                      every head) -> PlannedNormOverSplit: weight split as the column's rows,
                      the sum of squares all-reduced ([..., 1]; backward: all-reduced again).
    NoParallel        parameters replicated on every rank and used on the same data (nothing
                      to sum); it only marks them as planned (torchtitan's name). On a
                      module that holds split layers too, it covers its own parameters only.
    PrepareModuleInput / PrepareModuleOutput  a module's inputs / outputs moved between layouts:
                      Shard(d) -> Replicate(): all-gather along d, backward this rank's slice
                      (the gradient of replicated code is whole on every rank); the column
                      layers that read that gathered input skip their `f` and share one
                      reduce-scatter of their partial gradients instead (for_column_layers);
                      Replicate() -> Shard(d): this rank's slice, backward all-gather. E.g.
                      an attention that reads T from its input gets the whole sequence; its
                      column layers then take Replicate() input.

Activations are sequence-first inside our layers (`[s, b, h]`). A batch-first model says
Shard(1): each layer's input is transposed to sequence-first (a view), and its output back and
made contiguous, as nn.Linear's would be. Dropout: a SequenceParallel entry draws exactly one
device's masks (every rank holds the same generator state and draws the full mask), so a TP run
with such dropouts equals one device's run from the same seed; drawing p times the random
numbers a rank needs is the price of that. Between a column layer whose output stays split and
its row layer (the TP region) the default generators draw from a stream of this rank's own
(random.py, Megatron's RNG tracker): a dropout there marked NoParallel(), or one inside a
function (`F.scaled_dot_product_attention(dropout_p=...)`), masks each rank's heads differently,
cheaply, but no longer as one device would. An nn.Dropout still needs an entry: which region
it runs in is not visible from the plan.

Outputs are plain tensors, this rank's part: ColwiseParallel / RowwiseParallel take only
use_local_output=True (code written for PyTorch's DTensor output reads global shapes, e.g. a
view with every head, and would compute another thing); SequenceParallel and PrepareModule*
take either value, their outputs read the same by elementwise code, but code between them and
the next planned layer that reads a length there sees this rank's part. And a layer takes its
input in the layout its input_layouts say: PyTorch redistributes a DTensor that arrives in
another layout, here the plan must say the layout it arrives in (e.g. PrepareModuleInput to
gather a norm's Shard(1) output before an attention whose column layers take Replicate()).

Refused in one line, before any collective: a key matching no module, a module matched twice
or planned by an earlier call, a style on a module it cannot split, sizes p does not divide
(a vocabulary aside: an embedding's rows, a gathered head's, are padded),
use_local_output=False on a column or row layer, a PyTorch style we do not carry out
(PrepareModuleInputOutput, a subclass, another ParallelStyle) or one carrying an attribute we
would not honour (ColwiseParallel's desired_input_layouts other than (Replicate(),), any
attribute a later PyTorch adds); at the first forward, before its collectives: a parameter no
entry covers (it would stay a per-rank tensor with a partial gradient; PyTorch leaves modules
that see the same data on every rank out of its plans, we ask for NoParallel), an nn.Dropout
with p > 0 no entry covers, a tied weight split on one side only; at run time, before the
collective, a sequence p does not divide (refused, not padded: padding would change the
model's output shape).
"""
import difflib
import fnmatch
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from ..comm import group_size
from ..config import check_divisible, check_overlap_option
from ..guards.agreement import check_ranks_agree, module_fingerprint
from ..guards.guard import attach_guards, guard_options
from ..parallel_linear import layout_of, shard
from .layers import (PlannedColumn, PlannedConvColumn, PlannedConvRow, PlannedEmbedding,
                     PlannedNormOverSplit, PlannedRow, SequenceParallelDropout, rms_norm_eps)
from .coverage import check_at_first_forward, check_plan_coverage
from .sequence_parallel import sum_gradients_in_graph
from .random import attach_random_stream
from .styles import (ColwiseParallel, NoParallel, NormOverSplit, PrepareModuleInput,
                     PrepareModuleOutput, column_rows, RowwiseParallel, SequenceParallel, is_style,
                     layout_or, layout_pairs, prepare_hook, sequence_dim, translate_style)


# ----------------------------------------------------------------------------------------------
# Reading a plan
# ----------------------------------------------------------------------------------------------
def matching_modules(module, key, prefix=""):
    """[(name, module)] that `key` names, read as PyTorch's parallelize_module reads it: the
    key split at dots, each token matched with fnmatch against the children's names at its
    depth ("h.*.attn" is every child of h, then its `attn`); "" is `module` itself."""
    if key == "":
        return [(prefix, module)]
    token, _, rest = key.partition(".")
    found = []
    for name, child in module.named_children():
        if fnmatch.fnmatch(name, token):
            full = f"{prefix}.{name}" if prefix else name
            found += matching_modules(child, rest, full) if rest else [(full, child)]
    return found


def _check_conv(conv, style, where):
    """A Conv2d is split as a matmul over its channels (dim 1) at every pixel: only a plain 1x1
    convolution is one, and only with classic TP's layouts (the whole activations on every
    rank, the channels split between the column and the row layer)."""
    settings = {"kernel_size": (conv.kernel_size, (1, 1)), "stride": (conv.stride, (1, 1)),
                "padding": (conv.padding, (0, 0)), "dilation": (conv.dilation, (1, 1)),
                "groups": (conv.groups, 1)}
    for name, (value, plain) in settings.items():
        if value != plain and not (name == "padding" and value == "valid"):
            raise ValueError(f"{where}: Conv2d {name}={value!r} is not supported; tensor "
                             f"parallelism here needs a plain 1x1 convolution (kernel_size="
                             f"(1, 1), stride=(1, 1), padding=0, dilation=(1, 1), groups=1)")
    whole = style.input_layouts if isinstance(style, ColwiseParallel) else style.output_layouts
    split = style.output_layouts if isinstance(style, ColwiseParallel) else style.input_layouts
    if not isinstance(layout_or(whole, Replicate()), Replicate) or split is not None:
        raise ValueError(f"{where}: a 1x1 Conv2d takes the default layouts only (the whole "
                         f"[B, C, H, W] on every rank, its channels split between the column "
                         f"and the row layer); got input_layouts={style.input_layouts!r}, "
                         f"output_layouts={style.output_layouts!r}")


def _check_style(name, module, style, p):
    """One line for anything `style` cannot do to `module` over p ranks."""
    where = f"{type(style).__name__} at {name!r}"
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and style.use_local_output is not True:
        raise ValueError(f"{where}: use_local_output={style.use_local_output!r}: valid is True; "
                         f"the output here is a plain tensor, this rank's part, and code written "
                         f"for PyTorch's DTensor output (global shapes) would compute another "
                         f"thing")
    if isinstance(style, ColwiseParallel):
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            raise ValueError(f"{where}: {type(module).__name__} cannot be split by columns here; "
                             f"ColwiseParallel takes an nn.Linear or a 1x1 nn.Conv2d")
        conv = isinstance(module, nn.Conv2d)
        if conv:
            _check_conv(module, style, where)
        n_out = module.out_channels if conv else module.out_features
        out_name = "out_channels" if conv else "out_features"
        sequence_dim(layout_or(style.input_layouts, Replicate()), "input_layouts", where)
        out = layout_or(style.output_layouts, Shard(-1))
        if not (isinstance(out, Replicate) or (isinstance(out, Shard) and out.dim == -1)):
            raise ValueError(f"{where}: output_layouts={out!r}: valid are Shard(-1) (this "
                             f"rank's features) and Replicate() (gathered)")
        if style.output_sizes is not None:
            sizes = tuple(style.output_sizes)
            if conv or style.output_shape is not None or isinstance(out, Replicate):
                raise ValueError(f"{where}: output_sizes={sizes} takes neither output_shape nor "
                                 f"output_layouts=Replicate(); give one row layout, output split")
            if sum(sizes) != n_out or any(n % p for n in sizes):
                raise ValueError(f"{where}: output_sizes={sizes}: valid are block sizes that sum "
                                 f"to {out_name}={n_out}, each a multiple of the TP size {p}")
            return
        if style.output_shape is None:
            if style.split_dim:
                raise ValueError(f"{where}: split_dim={style.split_dim} without output_shape; "
                                 f"give output_shape, or leave split_dim at 0")
            if n_out % p and not isinstance(out, Replicate):
                raise ValueError(f"{where}: {out_name}={n_out} is not divisible by the TP size "
                                 f"{p}: only a gathered output (output_layouts=Replicate(), an "
                                 f"LM head's logits) is padded; left split, pad the layer to "
                                 f"{n_out + (-n_out) % p} yourself and give "
                                 f"vocab_parallel_cross_entropy vocab_size={n_out}")
            return
        shape = tuple(style.output_shape)
        if math.prod(shape) != n_out:
            raise ValueError(f"{where}: output_shape={shape} holds {math.prod(shape)} rows, the "
                             f"layer has {out_name}={n_out}")
        if not 0 <= style.split_dim < len(shape):
            raise ValueError(f"{where}: split_dim={style.split_dim}: valid are 0..{len(shape) - 1}")
        if shape[style.split_dim] % p:
            raise ValueError(f"{where}: output_shape={shape} split along dim {style.split_dim}: "
                             f"{shape[style.split_dim]} is not divisible by the TP size {p}")
        if isinstance(out, Replicate):
            raise ValueError(f"{where}: output_layouts=Replicate() with an output_shape: the "
                             f"gathered rows would be in rank order, not the layer's")
    elif isinstance(style, RowwiseParallel) and isinstance(module, nn.Conv2d):
        _check_conv(module, style, where)
        check_divisible(f"{where}: in_channels", module.in_channels, p)
    elif isinstance(style, RowwiseParallel):
        inp = layout_or(style.input_layouts, Shard(-1) if isinstance(module, nn.Linear)
                      else Replicate())
        out = sequence_dim(layout_or(style.output_layouts, Replicate()), "output_layouts", where)
        if isinstance(module, nn.Linear):
            if not (isinstance(inp, Shard) and inp.dim == -1):
                raise ValueError(f"{where}: input_layouts={inp!r}: a row-parallel Linear takes "
                                 f"this rank's features, Shard(-1)")
            check_divisible(f"{where}: in_features", module.in_features, p)
        elif isinstance(module, nn.Embedding):
            if not isinstance(inp, Replicate):
                raise ValueError(f"{where}: input_layouts={inp!r}: an nn.Embedding takes the "
                                 f"whole ids, Replicate() (output Shard(d): this rank's sequence "
                                 f"rows; Replicate(): the whole lookup)")
            if module.max_norm is not None:
                raise ValueError(f"{where}: max_norm={module.max_norm} is not supported (the "
                                 f"lookup would renormalise rows in place); valid is None")
            if type(module).forward is not nn.Embedding.forward and \
                    getattr(module, "embed_scale", None) is None:
                raise ValueError(f"{where}: {type(module).__name__} has a forward of its own, "
                                 f"which the vocabulary-parallel lookup would replace; valid "
                                 f"are nn.Embedding and transformers' scaled word embeddings "
                                 f"(the lookup times their embed_scale)")
        else:
            raise ValueError(f"{where}: {type(module).__name__} cannot be split by rows here; "
                             f"RowwiseParallel takes an nn.Linear, a 1x1 nn.Conv2d or an "
                             f"nn.Embedding")
    elif isinstance(style, NormOverSplit):
        rms_norm_eps(module, where)
        check_divisible(f"{where}: the norm's features", module.weight.shape[0], p)
    elif isinstance(style, PrepareModuleOutput):
        layout_pairs(style.output_layouts, style.desired_output_layouts, where)
    elif isinstance(style, PrepareModuleInput):
        layout_pairs(style.input_layouts, style.desired_input_layouts, where)
        kw_have, kw_want = style.input_kwarg_layouts or {}, style.desired_input_kwarg_layouts or {}
        layout_pairs(tuple(kw_have.get(k) for k in kw_want), tuple(kw_want.values()), where)
    elif isinstance(style, SequenceParallel) and isinstance(module, nn.Dropout) and \
            style.sequence_dim < 0:
        raise ValueError(f"{where}: sequence_dim={style.sequence_dim}: give it as a dim >= 0")


def _plan_dict(plan):
    if isinstance(plan, dict):
        return plan
    if is_style(plan):  # one style: for the module it is given with
        return {"": plan}
    raise ValueError(f"plan must be a dict {{module name pattern: style}} or one style, got "
                     f"{type(plan).__name__}")


def resolve_plan(module, plan, p):
    """{module name: (module, style)} for `plan` (a dict, or one style for `module` itself),
    PyTorch's styles read into ours, every check this plan alone allows made (no
    communication). Whether it covers every parameter waits for the first forward
    (`check_plan_coverage`): a plan may come in several calls."""
    plan = _plan_dict(plan)
    names = [n for n, _ in module.named_modules() if n]
    matched = {}
    for key, given in plan.items():
        style = translate_style(given, f"plan[{key!r}]")
        found = matching_modules(module, key)
        if not found:
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
            raise ValueError(f"plan key {key!r} matches no module of {type(module).__name__}"
                             + (f"; did you mean {', '.join(map(repr, close))}?" if close else
                                f"; its children are {[n for n, _ in module.named_children()]}"))
        for name, mod in found:
            if name in matched:
                raise ValueError(f"module {name!r} is matched by two plan keys, "
                                 f"{matched[name][2]!r} and {key!r}; keep one")
            earlier = getattr(mod, "plan_style", None)
            if earlier is not None:
                raise ValueError(f"module {name!r} ({type(mod).__name__}) is planned already, "
                                 f"{earlier!r}, by an earlier call; plan each module once")
            _check_style(name, mod, style, p)
            matched[name] = (mod, style, key)
    return {name: (mod, style) for name, (mod, style, _) in matched.items()}


# ----------------------------------------------------------------------------------------------
# Carrying it out
# ----------------------------------------------------------------------------------------------
def _replacement(name, mod, style, group, overlap):
    """The module that takes `mod`'s place (or `mod` itself, changed in place)."""
    where = f"{type(style).__name__} at {name!r}"
    if isinstance(style, ColwiseParallel):
        if isinstance(mod, nn.Conv2d):
            return PlannedConvColumn(mod, group, style.output_shape, style.split_dim, where)
        out = layout_or(style.output_layouts, Shard(-1))
        rows = None if style.output_sizes is None else column_rows(style, group_size(group))
        return PlannedColumn(mod, group, overlap,
                             sequence_dim(layout_or(style.input_layouts, Replicate()), "", where),
                             isinstance(out, Replicate), style.output_shape, style.split_dim,
                             where, rows=rows)
    if isinstance(style, RowwiseParallel):
        out = sequence_dim(layout_or(style.output_layouts, Replicate()), "", where)
        if isinstance(mod, nn.Embedding):
            return PlannedEmbedding(mod, group, out, where)
        if isinstance(mod, nn.Conv2d):
            return PlannedConvRow(mod, group, where)
        return PlannedRow(mod, group, overlap, out, where)
    if isinstance(style, NormOverSplit):
        return PlannedNormOverSplit(mod, group, rms_norm_eps(mod, where), where)
    if isinstance(style, PrepareModuleInput):
        mod.register_forward_pre_hook(prepare_hook(style, group, where), with_kwargs=True)
    if isinstance(style, PrepareModuleOutput):
        mod.register_forward_hook(prepare_hook(style, group, where))
    if isinstance(style, SequenceParallel):
        if isinstance(mod, nn.Dropout):
            return SequenceParallelDropout(mod.p, style.sequence_dim, group)
        sum_gradients_in_graph(mod, group)
    return mod


def _set_module(root, name, new):
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)


def _become(module, new):
    """`module` turned into `new` in place, its class and state, the hooks registered on it
    kept: the module a call is given has no parent here to hold a replacement, and whoever
    holds it (PyTorch's parallelize_module changes a module in place) holds the split one."""
    hooks = {k: v for k, v in vars(module).items() if "hook" in k}
    vars(module).clear()
    vars(module).update(vars(new), **hooks)
    module.__class__ = type(new)


@torch.no_grad()
def _copy_shards(old, new, group):
    """Each of `new`'s parameters gets this rank's shard of `old`'s. The full weight keeps a
    mark (`split_into`: the shard and its name), so a module that shares it (a tied weight),
    converted in this call or a later one, gets the same Parameter again."""
    for pname, param in list(new.named_parameters(recurse=False)):
        full = getattr(old, pname)
        layout = layout_of(new, pname)
        twin = getattr(full, "split_into", None)
        if twin is not None:
            split, split_name, split_owner = twin
            if split.shape != param.shape or \
                    layout_of(split_owner, split_name.rsplit(".", 1)[-1]).dim != layout.dim:
                raise ValueError(f"{split_name} and {new.where}.{pname} are one tied weight split "
                                 f"two ways ({list(split.shape)} and {list(param.shape)}); split "
                                 f"both the same way (e.g. both by vocabulary rows)")
            setattr(new, pname, split)
            continue
        param.copy_(shard(full.detach(), layout, group))
        full.split_into = (param, f"{new.where}.{pname}", new)


def parallelize_module(module, tp_group, plan, *, overlap=False, check_ids=None,
                       same_batch="check", check_replicated_grads="first", tp_seed=None):
    """Carry out `plan` on `module`, in place, over `tp_group`; returns `module`, guarded.

    `plan`: {module name pattern: style}, or one style for `module` itself (an nn.Linear given
    ColwiseParallel() becomes the column layer in place: its class and weights change, the
    object stays). The styles are ours or PyTorch's own (`torch.distributed.tensor.parallel`),
    read with the same arguments. A plan may come in several calls, as PyTorch allows (the
    root's entries, then each block's, then a bare style on one module): whether it covers
    every parameter is checked at the first forward of the outermost planned module.

    Every rank must hold the same full weights beforehand (same seed or checkpoint): each keeps
    its shards of them. `overlap=True`: the sequence-parallel layers use the ring
    (parallel_linear.py). It ends with `guard`'s checks attached (guards/guard.py,
    `attach_guards`), with these three options: the ranks fed the same batch, ids in range,
    every parameter kept whole with the same gradient on every rank after the first backward.
    `tp_seed` (re)seeds the TP region's random stream (random.py; None: torch.initial_seed()
    when the group's stream is first made), `module.tp_random` after the call.

    Everything is checked before any communication (see the module docstring); then the ranks
    compare the plan, the options, every parameter's shape, dtype and a checksum of its values,
    in one tiny all-gather, so ranks holding different weights, plans or guards are refused on
    every rank: the door's one comparison (the guard does not compare again after the split).
    """
    options = guard_options(check_ids=check_ids, same_batch=same_batch,
                            check_replicated_grads=check_replicated_grads)
    check_overlap_option(overlap)
    p = group_size(tp_group)
    matched = resolve_plan(module, plan, p)
    values = {f"sum:{n}": repr(t.detach().double().sum().item())
              for n, t in module.named_parameters()}
    styles = sorted(((n, s) for n, (_, s) in matched.items()), key=repr)
    # The one comparison of this door: the full weights, the plan and the options, before the
    # split (the shards then follow from them alike on every rank; `attach_guards` below does
    # not compare again).
    check_ranks_agree(module_fingerprint(module, plan=repr(styles), overlap=overlap, tp_size=p,
                                         **values, **options),
                      tp_group, "models or plans for parallelize_module")
    for name, (mod, style) in matched.items():
        new = _replacement(name, mod, style, tp_group, overlap)
        if new is not mod:
            if isinstance(style, (ColwiseParallel, RowwiseParallel, NormOverSplit)):
                _copy_shards(mod, new, tp_group)
            new.train(mod.training)
            if name:
                _set_module(module, name, new)
            else:
                _become(mod, new)
                new = mod
        new.plan_style = style
    module.tp_random = attach_random_stream(module, tp_group, tp_seed)
    check_at_first_forward(module)  # local, so before the guard's batch comparison
    return attach_guards(module, tp_group, options)


__all__ = ["ColwiseParallel", "NoParallel", "NormOverSplit", "PrepareModuleInput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "check_plan_coverage",
           "matching_modules", "parallelize_module", "resolve_plan"]
