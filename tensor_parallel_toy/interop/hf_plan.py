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
    colwise_gather_output / rowwise_split_input inside a block: refused, naming the entry (the
                                    projection's output is sliced after it as one whole tensor)

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
layers take the whole input (`f`), and its `rowwise` layer reduce-scatters back to Shard(1).
The gather and `f` cost an all-gather forward and an all-reduce backward where Megatron's
all-gather + GEMM reduce-scatters; the price of not knowing what the module reads.
"""
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from ..apply.plan import matching_modules
from ..apply.styles import (ColwiseParallel, NoParallel, PrepareModuleInput, RowwiseParallel,
                            SequenceParallel)

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


def hf_plan(model, *, sequence_parallel=True):
    """The plan for `parallelize_module(model, tp_group, plan)` read from `model.tp_plan`, the
    Hugging Face model's own (see the module docstring); TP + SP by default, classic TP with
    `sequence_parallel=False`. Reads the model, changes nothing."""
    strings = dict(getattr(model, "tp_plan", None) or {})
    if not strings:
        raise ValueError(f"{type(model).__name__} has no tp_plan (config.base_model_tp_plan and "
                         f"the head's _tp_plan are empty); hf_plan reads a transformers 5.x "
                         f"model's own plan")
    layers = _layer_list(model, strings)
    plan, gathered_parents = {}, set()
    for key, string in strings.items():
        if string in MOE_STRINGS:
            _refuse(key, string, "is a mixture-of-experts style, which this package does not "
                                 "split (dense decoders only)")
        if string in NOT_CARRIED_OUT or string not in TRANSLATED:
            _refuse(key, string, "is not carried out by this package")
        if not matching_modules(model, key):
            _refuse(key, string, f"names no module of {type(model).__name__} (a parameter's "
                                 f"entry is an MoE or quantization style)")
        in_block = key.startswith(layers + ".")
        if string == "embedding_rowwise":
            plan[key] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif string == "colwise":
            if not in_block:
                _refuse(key, string, "outside the decoder layers leaves its output split for "
                                     "code hf_plan cannot see")
            plan[key] = ColwiseParallel()
            gathered_parents.add(key.rpartition(".")[0])
        elif string == "rowwise":
            plan[key] = RowwiseParallel(output_layouts=SEQUENCE if sequence_parallel else None)
        elif string == "colwise_gather_output" and not in_block:  # the head: whole logits
            plan[key] = ColwiseParallel(input_layouts=SEQUENCE if sequence_parallel else None,
                                        output_layouts=Replicate())
        elif string in ("replicated_with_grad_allreduce", "sequence_parallel"):
            plan[key] = SequenceParallel()
        else:
            _refuse(key, string, "inside a block gathers a projection whose output the model "
                                 "slices as one whole tensor (a fused projection, or a norm "
                                 "over every head); not split here for this family")
    if sequence_parallel:
        for parent in sorted(gathered_parents):
            plan[parent] = PrepareModuleInput(
                input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),),
                input_kwarg_layouts={"hidden_states": SEQUENCE},
                desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan[f"{layers}.0"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                 desired_input_layouts=(SEQUENCE,))
    plan.update(_whole_weights(model, plan, gathered_parents, sequence_parallel))
    return plan


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


__all__ = ["MOE_STRINGS", "NOT_CARRIED_OUT", "TRANSLATED", "hf_plan"]
