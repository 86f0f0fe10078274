"""The same baseline `Transformer`, parallelized by PyTorch's own DTensor tensor parallelism.

This is what one would write with `torch.distributed.tensor.parallel` instead of the
hand-written layers: a plan that maps module names to parallel styles, applied to the plain
single-device model by `parallelize_module`. Our activations are sequence-first, `[s, b, h]`,
so every sequence shard is `Shard(0)` (PyTorch's examples use `[b, s, h]` and `Shard(1)`).

    embed        RowwiseParallel   vocab rows split; output reduce-scattered to Shard(0)
    *_norm       SequenceParallel  replicated weight applied to this rank's s/p rows
    attn, mlp    PrepareModuleInput  Shard(0) -> Replicate(): all-gather the sequence
    qkv, fc1     ColwiseParallel   output features split: [s, b, 3h/p], [s, b, f/p]
    proj, fc2    RowwiseParallel   input features split; output reduce-scattered to Shard(0)
    head         ColwiseParallel   vocab split, logits stay a DTensor for `loss_parallel`

The fused qkv weight is laid out k/v head by k/v head (`[nkv, (g q heads, k, v), head_dim]`), so
a Colwise row shard holds whole k/v heads with the query heads that read them, and the attention
code's `unflatten(-1, (-1, g + 2, head_dim))` works on the local shard unchanged.

The sequence-parallel trap. A replicated weight applied to sequence-sharded activations (the
norms) gets a gradient that is only a partial sum over this rank's tokens: DTensor marks it
`Partial()` rather than reducing it. DTensor ops that later read it (the optimizer's) reduce it
implicitly, once per op that reads it, but anything that takes the local tensor (a gradient
norm from local shards, a custom optimizer, a hook, a check) silently sees 1/p of the tokens.
`reduce_partial_grads` puts every gradient into its parameter's own placement once per step
(one all-reduce per norm weight, like the one in the hand-written norm's backward), after which a
replicated gradient is the full gradient on every rank.

The second half of the file applies the same styles to a Hugging Face Llama / Mistral / Qwen2 /
Qwen3 model itself (`parallelize_hf_model`), so that the two implementations can be compared on
a real architecture with the same weights (`from_hf` / `to_hf` convert them). That plan covers
every parameter of the families it accepts or refuses the model (`check_plan_covers`): a
parameter it leaves out would stay a plain per-rank tensor, and its gradient a partial sum.
"""
import fnmatch

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from ..guards.agreement import check_ranks_agree, module_fingerprint
from ..comm import all_reduce_
from ..config import check_divisible, pad_sequence
from ..guards.guard import attach_guards, guard, guard_options
from ..guards.replicated_grads import check_every_option


def transformer_plan(config):
    """The parallelize plan for `Transformer(config)`, by module name."""
    seq_shard = Shard(0)  # our activations are [s, b, h]
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_shard),
        "norm": SequenceParallel(sequence_dim=0),
        "head": ColwiseParallel(input_layouts=seq_shard, output_layouts=Shard(-1),
                                use_local_output=False),  # DTensor logits for loss_parallel
    }
    for i in range(config.num_layers):
        block = f"layers.{i}"
        plan.update({
            # Whole k/v heads with their query heads, as long as each rank gets at least one
            # k/v head (checked by `check_transformer_plan`).
            f"{block}.attn.qkv": ColwiseParallel(),
            f"{block}.attn_norm": SequenceParallel(sequence_dim=0),
            # Attention.forward(x, cos, sin): only x is an activation to gather.
            f"{block}.attn": PrepareModuleInput(input_layouts=(seq_shard, None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
            f"{block}.attn.proj": RowwiseParallel(output_layouts=seq_shard),
            f"{block}.mlp_norm": SequenceParallel(sequence_dim=0),
            f"{block}.mlp": PrepareModuleInput(input_layouts=(seq_shard,),
                                               desired_input_layouts=(Replicate(),)),
            f"{block}.mlp.fc1": ColwiseParallel(),
            f"{block}.mlp.fc2": RowwiseParallel(output_layouts=seq_shard),
        })
    return plan


def check_transformer_plan(config, tp_size):
    """What this plan cannot express, refused in one line before any collective."""
    config.check_tp_size(tp_size)  # what no TP split of this model can take
    check_divisible("vocab_size", config.vocab_size, tp_size, "PyTorch's plan does not pad the "
                    "vocabulary (the package's Transformer does)")
    if config.tie_embeddings:
        raise ValueError("tie_embeddings=True: parallelize_module gives the embedding and the "
                         "head each a new DTensor parameter, silently untying them; untie them "
                         "or leave the dtensor mode out")
    if config.mlp != "gelu":
        raise ValueError(f"mlp={config.mlp!r}: this plan names the GELU MLP's fc1/fc2 (a "
                         f"Colwise shard of gate_up would hold gate rows only); for a "
                         f"Llama-style model use parallelize_hf_model on the Hugging Face model")
    if config.qk_norm:
        raise ValueError("qk_norm=True: this plan has no style for the per-head norms, whose "
                         "gradients would stay partial sums over each rank's heads; leave the "
                         "dtensor mode out")
    if config.num_kv_heads < tp_size:
        raise ValueError(f"num_kv_heads={config.num_kv_heads} < TP size {tp_size}: the dtensor "
                         f"plan cannot replicate k/v heads; use at least {tp_size} k/v heads or "
                         f"leave the dtensor mode out")


def parallelize_transformer(model, tp, device_type="cpu", *, check_replicated_grads="first"):
    """Shard a baseline `Transformer` (built with tp_group=None) in place over `tp`: a process
    group, or a 1-D DeviceMesh (the "tp" dimension of a 2-D mesh, for `fully_shard` over its
    "dp" dimension afterwards: see data_parallel.py).

    Every rank must pass the same full model (e.g. `Transformer(config, seed=s)`): each keeps
    its own shard of every split weight, so the result starts from the baseline's weights.
    Ends with `guard(model, group, check_replicated_grads=...)` (guards/guard.py), as every
    door into the package does: ranks agree on the model and each batch, ids in range, the
    replicated gradients compared ("first", the default, or N; None: off).
    """
    mesh = tp if isinstance(tp, DeviceMesh) else DeviceMesh.from_group(tp, device_type)
    check_transformer_plan(model.config, mesh.size())
    check_every_option(check_replicated_grads)
    model = parallelize_module(model, mesh, transformer_plan(model.config))
    return guard(model, mesh.get_group(), check_replicated_grads=check_replicated_grads)


def transformer_loss(model, input_ids, labels):
    """Mean cross-entropy on vocab-sharded logits: `loss_parallel` computes the softmax
    without gathering `[b, s, V]`. Backward must run inside the same context, so call
    `.backward()` on the result within `loss_parallel()` too (as
    `transformer_loss_and_backward` does)."""
    logits = model(input_ids)  # DTensor [b, s, V], Shard(2)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def transformer_loss_and_backward(model, input_ids, labels):
    """One forward + backward; returns the (replicated) loss as a plain scalar tensor."""
    with loss_parallel():
        value = transformer_loss(model, input_ids, labels)
        value.backward()
    return value.to_local().detach()


@torch.no_grad()
def reduce_partial_grads(model):
    """Give each gradient its parameter's placement: `Partial()` -> `Replicate()` is the
    all-reduce of the sequence-parallel partial sums; a `Replicate()` gradient of a sharded
    parameter (the embedding's) is cut down to this rank's shard. Returns how many changed."""
    changed = 0
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)
            changed += 1
    return changed


@torch.no_grad()
def placement_grad_norm(model, tp_group):
    """Global L2 norm of the gradients, from local shards, read from the DTensor placements:
    a `Shard` gradient's local squares are summed over the group, a `Replicate` one is counted
    once. A `Partial` gradient has no meaningful local norm: reduce it first. For the 1-D TP
    mesh only; after `fully_shard` (2-D placements) use
    `torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])`, which reads every
    mesh dimension's placement."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        sq = local.double().pow(2).sum().cpu()
        placements = grad.placements if isinstance(grad, DTensor) else (Replicate(),)
        if any(isinstance(p, Partial) for p in placements):
            raise ValueError(f"{name}: gradient is Partial (an unreduced sequence-parallel "
                             f"partial sum); call reduce_partial_grads(model) first")
        if any(isinstance(p, Shard) for p in placements):
            sharded += sq
        else:
            replicated += sq
    device = next(model.parameters()).device
    sharded = all_reduce_(sharded.to(device), tp_group)
    return (sharded.cpu() + replicated).sqrt().item()


# ----------------------------------------------------------------------------------------------
# The same plan on a Hugging Face Llama / Mistral / Qwen2 / Qwen3 `...ForCausalLM`
# ----------------------------------------------------------------------------------------------
# Hugging Face activations are batch-first, [b, s, h]: the sequence shard is Shard(1).
#
#   model.embed_tokens          RowwiseParallel   vocab rows split; output all-reduced to
#                                                 Replicate() (see below)
#   model.layers.0              PrepareModuleInput  Replicate() -> Shard(1): a local slice
#   *_layernorm, model.norm     SequenceParallel  replicated weight on this rank's s/p rows
#   self_attn                   PrepareModuleInput  keyword hidden_states: Shard(1) -> Replicate()
#   q_proj, k_proj, v_proj      ColwiseParallel   whole heads per rank: [b, s, heads/p * hd]
#   q_norm, k_norm (Qwen3)      SequenceParallel(sequence_dim=2)  replicated weight [hd] on this
#                                                 rank's heads of [b, s, heads, hd] (see below)
#   o_proj, down_proj           RowwiseParallel   output reduce-scattered to Shard(1)
#   mlp                         PrepareModuleInput  Shard(1) -> Replicate()
#   gate_proj, up_proj          ColwiseParallel   [b, s, f/p] each
#   lm_head                     ColwiseParallel   vocab split, DTensor logits for loss_parallel
#
# Why the embedding's output is Replicate(): the model builds its position ids, rotary tables
# and causal mask from the embedding's output length. A Shard(1) output would make it build
# them for s/p positions, and every rank would rotate its tokens as if they were the first
# s/p. With the full-length embedding output the model's own position and mask code sees s
# positions, and the first layer's input is cut to this rank's rows (no communication). The
# price is one all-reduce instead of a reduce-scatter, once per step.
#
# Why q_norm and k_norm are SequenceParallel along dim 2: Qwen3 normalises each head of
# q_proj(x).view(b, s, heads, hd), and each rank holds only its own heads, all s tokens. That is
# the sequence-parallel norm's situation with heads in place of tokens: a replicated weight
# applied to this rank's part of a dimension, whose gradient is a partial sum over that part.
# Declaring the local [b, s, heads/p, hd] a Shard(2) of the full tensor makes the weight a
# replicated DTensor whose gradient DTensor marks Partial(), summed over the group by
# `reduce_partial_grads`; left out of the plan, the weight stays a plain tensor on each rank,
# the logits and the loss stay right, and its gradient is silently a partial sum.
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # what dtensor_plan knows, module by module
_PER_HEAD_NORMS = ("q_norm", "k_norm")


def dtensor_plan(hf_config):
    """The parallelize plan for a Hugging Face `...ForCausalLM` of one of `HF_MODEL_TYPES`, by
    module name, from its config (`model.config`)."""
    seq_shard = Shard(1)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Replicate()),
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                             desired_input_layouts=(seq_shard,),
                                             use_local_output=True),
        # A local output: the head's caller slices it (logits_to_keep) before the head.
        "model.norm": SequenceParallel(use_local_output=True),
        "lm_head": ColwiseParallel(input_layouts=seq_shard, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    for i in range(hf_config.num_hidden_layers):
        layer = f"model.layers.{i}"
        plan.update({
            f"{layer}.input_layernorm": SequenceParallel(),
            # The decoder layer calls self_attn(hidden_states=...): a keyword layout.
            f"{layer}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq_shard},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True),
            f"{layer}.self_attn.q_proj": ColwiseParallel(),
            f"{layer}.self_attn.k_proj": ColwiseParallel(),
            f"{layer}.self_attn.v_proj": ColwiseParallel(),
            f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=seq_shard),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            f"{layer}.mlp": PrepareModuleInput(input_layouts=(seq_shard,),
                                               desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            f"{layer}.mlp.gate_proj": ColwiseParallel(),
            f"{layer}.mlp.up_proj": ColwiseParallel(),
            f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=seq_shard),
        })
        if hf_config.model_type == "qwen3":  # [b, s, heads/p, hd]: this rank's heads
            plan.update({f"{layer}.self_attn.{norm}": SequenceParallel(sequence_dim=2,
                                                                       use_local_output=True)
                         for norm in _PER_HEAD_NORMS})
    return plan


def check_hf_plan(hf_config, tp_size):
    """What the Hugging Face plan cannot split, refused in one line before any collective."""
    get = lambda name: getattr(hf_config, name, None)  # noqa: E731
    if get("model_type") not in HF_MODEL_TYPES:
        raise ValueError(f"model_type={get('model_type')!r}: parallelize_hf_model has a plan for "
                         f"{', '.join(map(repr, HF_MODEL_TYPES))} only; another family's modules "
                         f"are not known to it, and a parameter it left out would train with a "
                         f"partial gradient")
    if get("tie_word_embeddings"):
        raise ValueError("tie_word_embeddings=True: parallelize_module gives the embedding and "
                         "the head each a new DTensor parameter, silently untying them")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "vocab_size", "hidden_size"):
        check_divisible(name, get(name), tp_size, "k/v heads are split, never replicated here")


# The styles that turn every parameter of the module they are applied to into a DTensor, whose
# gradient DTensor then keeps right (sharded, or replicated with a Partial() gradient).
_PARAMETER_STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel)


def check_plan_covers(model, plan):
    """Refuse, in one line naming the first module, a `model` holding a parameter that `plan`
    (module name -> style) neither shards nor makes a replicated DTensor. Such a parameter
    would stay a plain tensor on each rank, applied to this rank's part of the data: its
    gradient a partial sum, different on each rank, with no error anywhere."""
    # parallelize_module also takes fnmatch patterns ("model.layers.*.mlp") as keys.
    patterns = {key: style for key, style in plan.items() if any(c in key for c in "*?[")}
    for name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        styles = [plan[name]] if name in plan else []
        styles += [style for key, style in patterns.items() if fnmatch.fnmatchcase(name, key)]
        if own and not any(isinstance(style, _PARAMETER_STYLES) for style in styles):
            style = ", ".join(type(s).__name__ for s in styles) or "no entry"
            raise ValueError(
                f"{name or 'the model itself'} ({type(module).__name__}, parameters "
                f"{', '.join(own)}) is not covered "
                f"by the plan ({style}): its weights would stay plain per-rank tensors with "
                f"partial gradients; give it a ColwiseParallel, RowwiseParallel or "
                f"SequenceParallel entry, or use a supported model")


def parallelize_hf_model(hf_model, tp_mesh, *, check_replicated_grads="first"):
    """Shard a Hugging Face Llama / Mistral / Qwen2 / Qwen3 `...ForCausalLM` in place over the
    1-D `tp_mesh` with PyTorch's tensor + sequence parallel styles (plan above). Every rank
    must pass the same full model (the ranks compare its parameter shapes and dtypes, and the
    options, in one tiny all-gather). Feed it `pad_to_tp_size(...)` batches, take the loss with
    `hf_loss_and_backward`, and call `reduce_partial_grads` before reading gradients.

    Refused in one line before any collective: another model type, tied embeddings, sizes the
    TP size does not divide, and a module holding parameters the plan does not cover.
    It ends with `guard`'s checks attached (guards/guard.py, `attach_guards`; the ranks compared
    the model and the options before the split, once): the
    ranks agree on the model and each batch, ids in range, and after the first backward
    ("first", the default, or N; None: off) every replicated gradient that is not a DTensor
    `Partial` is the same on every rank (replicated_grads.py)."""
    check_hf_plan(hf_model.config, tp_mesh.size())
    plan = dtensor_plan(hf_model.config)
    check_plan_covers(hf_model, plan)
    options = guard_options(check_ids=None, same_batch="check",
                            check_replicated_grads=check_replicated_grads)
    group = tp_mesh.get_group()
    # The door's one comparison, before any collective of the plan; the guard's checks are
    # then attached without comparing again.
    check_ranks_agree(module_fingerprint(hf_model, model_type=hf_model.config.model_type,
                                         **options), group, "Hugging Face models")
    hf_model = parallelize_module(hf_model, tp_mesh, plan)
    return attach_guards(hf_model, group, options)


def pad_to_tp_size(input_ids, labels, tp_size, *, pad_id=0, ignore_index=-100):
    """ids and labels `[b, s]` -> `[b, s']`, s' the next multiple of tp_size.

    Sequence parallelism splits the sequence into tp_size equal shards, and an uneven split
    fails inside the collectives. The padding goes at the end, where causal attention hides it
    from every real token, with labels ignore_index so the loss skips it: the loss and the
    gradients are those of the unpadded batch.
    """
    return (pad_sequence(input_ids.t(), tp_size, pad_id).t().contiguous(),
            pad_sequence(labels.t(), tp_size, ignore_index).t().contiguous())


def hf_loss_and_backward(hf_model, input_ids, labels, ignore_index=-100):
    """Mean cross-entropy (labels already shifted, `[b, s]`, s a multiple of the TP size) on
    the vocab-sharded logits, and its backward, both inside `loss_parallel`. Returns the
    replicated loss as a plain scalar tensor."""
    with loss_parallel():
        logits = hf_model(input_ids, use_cache=False).logits  # DTensor [b, s, V], Shard(2)
        value = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                ignore_index=ignore_index)
        value.backward()
    return value.to_local().detach()
