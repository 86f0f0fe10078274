"""Any Hugging Face decoder split by its own TP plan, carried out by this package's layers.

Every `transformers` 5.x causal LM ships a plan of strings, `model.tp_plan` (the config's
`base_model_tp_plan`, the head's `_tp_plan` and the embedding's `"embedding_rowwise"`, merged,
keys relative to the `...ForCausalLM`). `hf_plan(model)` reads it into a plan in PyTorch's
words for the package's door:

    model = parallelize_module(model, tp_group, hf_plan(model))   # TP + SP, guarded
    out = model(input_ids, labels=labels)                         # out.loss, out.logits whole

The strings of dense decoders, and what each becomes (s: sequence_parallel=True):

    embedding_rowwise               RowwiseParallel(input Replicate(), output Replicate()):
                                    vocabulary rows split, the lookups summed by `g`
    colwise                         ColwiseParallel(): whole heads / features per rank
    rowwise                         RowwiseParallel(output Shard(1) if s else Replicate())
    colwise_gather_output  (head)   ColwiseParallel(input Shard(1) if s, output Replicate()):
                                    the logits gathered, so transformers' own loss runs on them
    replicated_with_grad_allreduce  SequenceParallel(): a weight kept whole on this rank's heads
                                    (Qwen3's, Gemma 3's per-head q/k norms), its gradient summed
                                    over the group in the graph
    sequence_parallel               SequenceParallel()
    colwise_gather_output on a fused projection inside a block, with its rowwise_split_input
    partner (transformers gathers the output because the model slices it afterwards), split
    here by the projection's own layout instead, so the code between runs on this rank's part:
      gate_up_proj (Phi-3, GLM-4)   ColwiseParallel(output_shape=(2, f), split_dim=1): a rank's
                                    gate rows then its up rows; the MLP's chunk(2) and the
                                    activation see this rank's f/p features
      qkv_proj (Phi-3)              ColwiseParallel(output_sizes=(heads*hd, kv*hd, kv*hd)): a
                                    rank's q, k and v heads side by side (needs tp_size, and
                                    each such attention gets a config with this rank's counts)
      its rowwise_split_input       RowwiseParallel(output Shard(1) if s else Replicate())
    colwise_gather_output on the projections of a module holding a norm over one's whole output
    (OLMo 2's and OLMo 3's q/k/v: q_norm and k_norm span every head at once, which is why
    transformers gathers), with their rowwise_split_input partner: split by heads instead
      q_proj, k_proj, v_proj        ColwiseParallel(): this rank's heads, as `colwise`
      q_norm, k_norm (not in the    NormOverSplit(): the norm's weight split as its projection's
      model's plan)                 rows, its sum of squares all-reduced ([b, s, 1] floats) so
                                    each rank normalises its heads by the statistic of all;
                                    attention then runs on this rank's heads only
      o_proj (rowwise_split_input)  RowwiseParallel(output Shard(1) if s else Replicate())
    colwise_gather_output / rowwise_split_input on any other layer inside a block: refused
    `hf_plan_upgrades(model, plan)` lists the entries so upgraded, beside transformers' strings.

Refused in one line naming the entry and what is valid: the MoE strings (grouped_gemm,
ep_dispatch_experts, moe_tp_experts, moe_identity_expert, packed_colwise, packed_rowwise,
ep_router), and those this package does not carry out (embedding_colwise, colwise_rep,
rowwise_rep, all_reduce, replicate, local_params, mla_kv_a_proj); so is a module with
parameters that no entry covers and that is not a norm.

What transformers' plan leaves out, added here: the norms between the blocks (and the final
norm) hold whole weights; with s they run on this rank's sequence rows (SequenceParallel(): the
gradient summed over the group), without it on the same data on every rank (NoParallel()).

Where the sequence is split. With s, the hidden states between blocks hold this rank's s/p
rows. But the model's own forward builds the positions (`arange(inputs_embeds.shape[1])`),
the cache positions, the causal and sliding-window masks, and the rotary cos / sin from the
embedding's output: a reduce-scattered embedding output would have every rank build them for
s/p positions, rotating its tokens as if they were the first ones and masking the wrong keys.
So the embedding's output stays whole (`g`, an all-reduce instead of a reduce-scatter, once a
step), the model builds its tables for s positions, and the split is the first decoder layer's
input (`PrepareModuleInput`, Replicate() -> Shard(1): this rank's slice, no communication).
Every layer then receives the whole-length masks and position embeddings as keyword arguments,
untouched, and this rank's rows as `hidden_states`. The sequence is gathered again by the head
(ColwiseParallel with input Shard(1): all-gather + GEMM), after the final norm, which runs on
this rank's rows like the others.

Inside a block, an attention reads its batch and length from its input
(`hidden_shape = (*hidden_states.shape[:-1], -1, head_dim)`) and an MLP may do anything between
its projections: each module holding a `colwise` layer gets its input gathered
(`PrepareModuleInput`, Shard(1) -> Replicate(), positional or `hidden_states=`), its column
layers take the whole input, and its `rowwise` layer reduce-scatters back to Shard(1). The
column layers that read the gathered input share one reduce-scatter of their partial input
gradients in the backward (apply/layers.py, `for_column_layers`), as Megatron's all-gather +
GEMM does, instead of an all-reduce each: measured on a Llama-like model (TP 2, hidden 256),
20 MiB sent per step and rank instead of 36.
"""
import copy

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from ..apply.plan import matching_modules
from ..apply.styles import (ColwiseParallel, NoParallel, NormOverSplit, PrepareModuleInput,
                            RowwiseParallel, SequenceParallel)

SEQUENCE = Shard(1)  # transformers' activations are batch-first, [b, s, h]

MOE_STRINGS = ("grouped_gemm", "ep_dispatch_experts", "moe_tp_experts", "moe_identity_expert",
               "packed_colwise", "packed_rowwise", "ep_router")
NOT_CARRIED_OUT = ("embedding_colwise", "colwise_rep", "rowwise_rep", "all_reduce", "replicate",
                   "local_params", "mla_kv_a_proj")
TRANSLATED = ("embedding_rowwise", "colwise", "rowwise", "colwise_gather_output",
              "rowwise_split_input", "replicated_with_grad_allreduce", "sequence_parallel")


def _refuse(key, string, why):
    raise ValueError(f"tp_plan entry {key!r}: {string!r} {why}; valid here are "
                     f"{', '.join(TRANSLATED)} (colwise_gather_output on the head)")


def _gate_up(model, key, tp_size):
    """A fused gate|up projection (Phi-3's, GLM-4's `gate_up_proj`, which the MLP chunks in
    two): each half split, a rank's shard its gate rows then its up rows, so the MLP's own
    chunk(2) gives it its gate and up features and the activation runs on them alone."""
    linear = matching_modules(model, key)[0][1]
    return ColwiseParallel(output_shape=(2, linear.out_features // 2), split_dim=1)


def _fused_qkv(model, key, tp_size):
    """A fused q|k|v projection laid out [q heads | k heads | v heads] (Phi-3's `qkv_proj`):
    each block split by whole heads, a rank's shard its q, k and v heads side by side. The
    attention slices that output at its head counts (`config.num_attention_heads * head_dim`,
    `num_key_value_heads`), so each such attention gets a config of its own with this rank's
    counts: the one change hf_plan makes to the model."""
    if tp_size is None:
        _refuse(key, "colwise_gather_output", "is a fused q|k|v split here by heads, which needs "
                                              "the TP size; give hf_plan(..., tp_size=p)")
    sizes = None
    for name, linear in matching_modules(model, key):
        attn = model.get_submodule(name.rpartition(".")[0])
        heads, kv_heads = attn.config.num_attention_heads, attn.num_key_value_heads
        if heads % tp_size or kv_heads % tp_size:
            raise ValueError(f"{name}: {heads} query and {kv_heads} k/v heads over the TP size "
                             f"{tp_size}: both must be multiples of it (whole heads per rank)")
        sizes = (heads * attn.head_dim, kv_heads * attn.head_dim, kv_heads * attn.head_dim)
        if sum(sizes) != linear.out_features:
            raise ValueError(f"{name}: out_features={linear.out_features} is not q|k|v of "
                             f"{heads} and 2 x {kv_heads} heads of {attn.head_dim}")
        attn.config = copy.copy(attn.config)
        attn.config.num_attention_heads = heads // tp_size
        attn.num_key_value_heads = kv_heads // tp_size
    return ColwiseParallel(output_sizes=sizes)


# A fused projection's name -> its split by its own layout (transformers gathers its output).
FUSED = {"gate_up_proj": _gate_up, "qkv_proj": _fused_qkv}


def _norms_over_whole_outputs(model, parent_key, projections):
    """{key: NormOverSplit()} for each norm inside the modules `parent_key` names whose 1-D
    weight is as wide as the whole output of one of `projections` (their names in the module):
    OLMo 2's q_norm over q_proj's every head, k_norm over k_proj's. Which projection feeds a
    norm is not visible from the model; one fed anything narrower or wider than the split
    output raises on its first input (PlannedNormOverSplit checks the width before its
    collective)."""
    found = {}
    for _, parent in matching_modules(model, parent_key):
        widths = {getattr(parent, name).out_features for name in projections
                  if isinstance(getattr(parent, name, None), nn.Linear)}
        for name, module in parent.named_modules():
            weight = getattr(module, "weight", None)
            if name and _is_norm(module) and isinstance(weight, nn.Parameter) and \
                    weight.dim() == 1 and weight.numel() in widths:
                found[f"{parent_key}.{name}"] = NormOverSplit()
    return found


def _is_norm(module):
    """A module that normalises each row of its input with a whole weight (by its kind)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(
        ("RMSNorm", "LayerNorm", "Norm"))


def _layer_list(model, keys):
    """The name of the ModuleList of decoder layers the plan's `...layers.*...` keys run over."""
    prefixes = {key.split(".*.")[0] for key in keys if ".*." in key}
    lists = [p for p in prefixes if isinstance(dict(model.named_modules()).get(p), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"the model's tp_plan runs over {sorted(prefixes) or 'no'} layer lists; "
                         f"hf_plan needs the decoder layers as one nn.ModuleList")
    return lists[0]


def hf_plan(model, *, sequence_parallel=True, tp_size=None):
    """The plan for `parallelize_module(model, tp_group, plan)` read from `model.tp_plan`, the
    Hugging Face model's own (see the module docstring); TP + SP by default, classic TP with
    `sequence_parallel=False`. Reads the model and changes nothing, but for a fused q|k|v
    (Phi-3's qkv_proj), which needs `tp_size`: each such attention is given a config of its
    own holding this rank's head counts (`_fused_qkv`).

    `tp_size` (default: the default group's size, where torch.distributed is initialized) is
    checked against the head counts: a column split of q, k and v gives each rank whole heads
    only where p divides both, and a k/v head cut in two would be a silently wrong model."""
    _check_heads(model, tp_size or (dist.get_world_size() if dist.is_available() and
                                    dist.is_initialized() else None))
    strings = dict(getattr(model, "tp_plan", None) or {})
    if not strings:
        raise ValueError(f"{type(model).__name__} has no tp_plan (config.base_model_tp_plan and "
                         f"the head's _tp_plan are empty); hf_plan reads a transformers 5.x "
                         f"model's own plan")
    layers = _layer_list(model, strings)
    plan, gathered_parents = {}, set()
    fused = {key: FUSED[key.rpartition(".")[2]] for key, string in strings.items()
             if string == "colwise_gather_output" and key.startswith(layers + ".")
             and key.rpartition(".")[2] in FUSED}
    gathered = {}  # a module inside the blocks -> its other gathered projections' names
    for key, string in strings.items():
        if string == "colwise_gather_output" and key.startswith(layers + ".") and \
                key not in fused:
            parent, _, name = key.rpartition(".")
            gathered.setdefault(parent, []).append(name)
    norms = {}  # the norms over a whole gathered output, split with it (OLMo 2's q/k norm)
    for parent, names in gathered.items():
        norms.update({k: v for k, v in _norms_over_whole_outputs(model, parent, names).items()
                      if k not in strings})
    by_heads = {parent for parent in gathered if any(k.startswith(parent + ".") for k in norms)}
    split_parents = {k.rpartition(".")[0] for k in fused} | by_heads
    for key, string in strings.items():
        if string in MOE_STRINGS:
            _refuse(key, string, "is a mixture-of-experts style, which this package does not "
                                 "split (dense decoders only)")
        if string in NOT_CARRIED_OUT or string not in TRANSLATED:
            _refuse(key, string, "is not carried out by this package")
        if not matching_modules(model, key):
            _refuse(key, string, f"names no module of {type(model).__name__} (a parameter's "
                                 f"entry is an MoE or quantization style)")
        in_block, parent = key.startswith(layers + "."), key.rpartition(".")[0]
        if string == "embedding_rowwise":
            plan[key] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif string == "colwise":
            if not in_block:
                _refuse(key, string, "outside the decoder layers leaves its output split for "
                                     "code hf_plan cannot see")
            plan[key] = ColwiseParallel()
            gathered_parents.add(parent)
        elif string == "rowwise":
            plan[key] = RowwiseParallel(output_layouts=SEQUENCE if sequence_parallel else None)
        elif key in fused:  # split by its own layout: this rank's heads / features only
            plan[key] = fused[key](model, key, tp_size)
            gathered_parents.add(parent)
        elif string == "colwise_gather_output" and parent in by_heads:  # its norm: NormOverSplit
            plan[key] = ColwiseParallel()
            gathered_parents.add(parent)
        elif string == "rowwise_split_input" and parent in split_parents:
            plan[key] = RowwiseParallel(output_layouts=SEQUENCE if sequence_parallel else None)
        elif string == "colwise_gather_output" and not in_block:  # the head: whole logits
            plan[key] = ColwiseParallel(input_layouts=SEQUENCE if sequence_parallel else None,
                                        output_layouts=Replicate())
        elif string in ("replicated_with_grad_allreduce", "sequence_parallel"):
            plan[key] = SequenceParallel()
        else:
            _refuse(key, string, "inside a block gathers a projection whose output the model "
                                 "reads as one whole tensor, and it is neither a fused "
                                 f"{' / '.join(FUSED)} nor under a norm over its whole output; "
                                 "not split here for this family")
    if sequence_parallel:
        for parent in sorted(gathered_parents):
            plan[parent] = PrepareModuleInput(
                input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),),
                input_kwarg_layouts={"hidden_states": SEQUENCE},
                desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan[f"{layers}.0"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                 desired_input_layouts=(SEQUENCE,))
    plan.update(norms)
    plan.update(_whole_weights(model, plan, gathered_parents, sequence_parallel))
    return plan


def _check_heads(model, p):
    """One line where p does not divide the model's query or k/v heads."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not p or not heads:
        return
    kv = getattr(config, "num_key_value_heads", None) or heads
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if n % p:
            valid = [d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0]
            raise ValueError(f"{name}={n} is not divisible by the TP size {p}: each rank must "
                             f"hold whole heads; valid TP sizes for this model: {valid}")


def hf_plan_upgrades(model, plan):
    """[(key, transformers' string, our style)] for each entry of `plan` (hf_plan's, for
    `model`) that splits what the model's own plan gathers: a projection inside a block marked
    colwise_gather_output split by its layout (a fused gate|up or q|k|v) or by heads (under a
    norm over all of them), its rowwise_split_input partner fed this rank's part, and each such
    norm (the string None: transformers' plan does not name it)."""
    strings = dict(model.tp_plan)
    layers = _layer_list(model, strings)
    return [(key, strings.get(key), style) for key, style in sorted(plan.items())
            if isinstance(style, NormOverSplit) or (
                key.startswith(layers + ".") and
                strings.get(key) in ("colwise_gather_output", "rowwise_split_input"))]


def _whole_weights(model, plan, split_parents, sequence_parallel):
    """{name: style} for every module holding parameters that no entry of `plan` reaches: a
    norm on the hidden states (SequenceParallel() with SP, NoParallel() without); a norm
    inside a module whose projections are split (it sees this rank's heads: per head or over
    all of them, the plan must say) or anything else is refused."""
    planned = [name for key in plan for name, _ in matching_modules(model, key)
               if not isinstance(plan[key], PrepareModuleInput)]
    split = [name for key in split_parents for name, _ in matching_modules(model, key)]
    found = {}
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if any(name == p or name.startswith(p + ".") for p in planned):
            continue
        if not _is_norm(module):
            raise ValueError(f"{name} ({type(module).__name__}) holds parameters that the "
                             f"model's tp_plan does not name and is not a norm; hf_plan splits "
                             f"the modules the plan names and keeps the norms whole, nothing "
                             f"else")
        inside = [p for p in split if name.startswith(p + ".")]
        if inside:
            raise ValueError(f"{name} ({type(module).__name__}) sits inside {inside[0]}, whose "
                             f"projections are split, and the model's tp_plan does not name it: "
                             f"it sees this rank's heads; valid is an entry "
                             f"'replicated_with_grad_allreduce' (a per-head norm)")
        found[name] = SequenceParallel() if sequence_parallel else NoParallel()
    return found


__all__ = ["MOE_STRINGS", "NOT_CARRIED_OUT", "TRANSLATED", "hf_plan", "hf_plan_upgrades"]
