"""Hugging Face decoders split by their own TP plan (`hf_plan`), carried out by
`parallelize_module`, against the same `transformers` model on one device.

Tiny random models built from configs (nothing downloaded), norm weights and biases drawn off
their defaults: Llama (GQA), Qwen3 (per-head q/k norms) and Gemma 3 (per-head q/k norms with
1 + weight, four norms a block, the embedding scaled by sqrt(hidden) and tied to the head, a
padding row, a sliding window of 4 beside a full-attention layer, logit soft-capping), Phi-3
and GLM-4 (fused projections split by their layout), OLMo 2 and OLMo 3 (q/k norms over every
head, split with q/k by `NormOverSplit`: its sum of squares all-reduced). At TP 2,
sequence parallelism on and off, on a batch that holds the padding id: transformers' own loss
(labels given to the model), the logits and every parameter's gradient, each rank's shard
against the matching slice of one device's. And every string a dense plan cannot be carried
out with is refused in one line naming the entry.
"""
import pytest
import torch
import torch.distributed as dist

from .helpers import (MODEL_FP32_TOL, assert_errors, assert_one_line, import_transformers,
                      max_rel_error, tiny_hf_model)

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=64)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                    final_logit_softcapping=3.0, pad_token_id=0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    # A vocabulary no TP size divides: the embedding and the gathered head pad it.
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(pad_token_id=0, vocab_size=61)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(pad_token_id=0, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"])),
}
BATCH, SEQ = 2, 12
DRAWN = 61  # ids and labels below every family's vocabulary size


def tiny_model(family, **change):
    """The family's random `...ForCausalLM` in fp32, eval mode, the same on every rank; TINY's
    sizes with the family's changes and `change`."""
    config_cls, model_cls, family_change = FAMILIES[family]
    return tiny_hf_model(config_cls, model_cls, **{**TINY, **family_change, **change})


def batch():
    """ids (holding id 0, a padding id where the config has one) and labels, a quarter
    ignored."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, DRAWN, (BATCH, SEQ), generator=gen)
    ids[:, 2] = 0
    labels = torch.randint(0, DRAWN, (BATCH, SEQ), generator=gen)
    labels[torch.rand(BATCH, SEQ, generator=gen) < 0.25] = -100
    return ids, labels


def errors_against_one_device(build, sequence_parallel):
    """{key: error} of the model split by its own plan against one device: loss, logits, and
    every gradient (this rank's shard against the slice of one device's)."""
    from tensor_parallel_toy.apply import parallelize_module
    from tensor_parallel_toy.interop.hf_plan import hf_plan
    from tensor_parallel_toy.parallel_linear import shard
    from tensor_parallel_toy.support.sharding import layouts

    group = dist.group.WORLD
    ref, tp = build(), build()
    tp = parallelize_module(tp, group, hf_plan(tp, sequence_parallel=sequence_parallel,
                                                    tp_size=dist.get_world_size(group)))
    ids, labels = batch()
    out_ref, out = ref(ids, labels=labels), tp(ids, labels=labels)
    out_ref.loss.backward()
    out.loss.backward()
    errors = {"loss": max_rel_error(out.loss, out_ref.loss),
              "logits": max_rel_error(out.logits, out_ref.logits)}
    split, mine = layouts(tp), dict(tp.named_parameters())
    for name, param in ref.named_parameters():
        errors["grad:" + name] = max_rel_error(mine[name].grad,
                                               shard(param.grad, split[name], group))
    return errors


def _on_rank_family(family, sequence_parallel):
    return errors_against_one_device(lambda: tiny_model(family), sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_by_its_own_plan_equals_one_device(pools, family, sequence_parallel):
    per_rank = pools(2).run(_on_rank_family, family, sequence_parallel)
    worst = assert_errors(per_rank, MODEL_FP32_TOL, f"{family} by hf_plan, tp=2, "
                                                    f"sequence_parallel={sequence_parallel}")
    names = [n for n, _ in tiny_model(family).named_parameters()]
    assert sum(k.startswith("grad:") for k in worst) == len(names), sorted(worst)


def _on_rank_generate(family):
    """Greedy tokens from transformers' own `generate` on the model split by its plan without
    SP (decoding feeds one token at a time: nothing to split along the sequence), against one
    device's; the KV cache holds this rank's k/v heads only."""
    from tensor_parallel_toy.apply import parallelize_module
    from tensor_parallel_toy.interop.hf_plan import hf_plan

    group = dist.group.WORLD
    ref, tp = tiny_model(family), tiny_model(family)
    tp = parallelize_module(tp, group, hf_plan(tp, sequence_parallel=False,
                                               tp_size=dist.get_world_size(group)))
    ids = batch()[0][:, :5]
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
                   return_dict_in_generate=True)
    with torch.no_grad():
        want, got = ref.generate(ids, **options), tp.generate(ids, **options)
    # The scores too: a tiny random model may repeat one token whatever its logits' errors.
    return (want.sequences.tolist(), got.sequences.tolist(),
            max_rel_error(torch.stack(got.scores), torch.stack(want.scores)))


@pytest.mark.parametrize("family", ["phi3", "olmo2"])
def test_transformers_generate_on_the_split_model_gives_one_devices_tokens(pools, family):
    for rank, (want, got, error) in enumerate(pools(2).run(_on_rank_generate, family)):
        assert got == want, f"{family}, rank {rank}: split {got} != one device {want}"
        assert error <= MODEL_FP32_TOL, f"{family}, rank {rank}: scores off by {error:.3g}"


def _on_rank_tp4(family):
    """Eight query heads and four k/v heads (TP 4 needs whole ones of each) at TP 4 with SP."""
    return errors_against_one_device(
        lambda: tiny_model(family, num_attention_heads=8, num_key_value_heads=4, head_dim=4), True)


@pytest.mark.parametrize("family", ["phi3", "olmo2"])
def test_tp4_equals_one_device_and_heads_tp_does_not_divide_are_refused(pools, family):
    worst = assert_errors(pools(4).run(_on_rank_tp4, family), MODEL_FP32_TOL,
                          f"{family} by hf_plan, tp=4")
    assert any(k.startswith("grad:") for k in worst), sorted(worst)
    from tensor_parallel_toy.interop.hf_plan import hf_plan
    message = None
    try:  # the tiny model's 2 k/v heads at TP 4: half a head per rank
        hf_plan(tiny_model(family), tp_size=4)
    except ValueError as e:
        message = str(e)
    assert_one_line(message, ["num_key_value_heads=2", "TP size 4", "[1, 2]"], family)


def refusals():
    """{case: the message hf_plan raised (None if it did not)}, one bad entry each; hf_plan
    reads the model and communicates nothing, so no ranks are needed."""
    from tensor_parallel_toy.interop.hf_plan import hf_plan

    transformers = import_transformers()
    layer = "model.layers.*"
    cases = {  # case: (family or a config, the plan entries changed, the words the error names)
        "moe": ("llama", {f"{layer}.mlp": "moe_tp_experts"}, ["moe_tp_experts", "mixture"]),
        "grouped_gemm": ("llama", {f"{layer}.mlp.up_proj": "grouped_gemm"}, ["grouped_gemm"]),
        "packed": ("llama", {f"{layer}.mlp.up_proj": "packed_colwise"}, ["packed_colwise"]),
        "ep_router": ("llama", {f"{layer}.mlp": "ep_router"}, ["ep_router"]),
        "embedding_colwise": ("llama", {"model.embed_tokens": "embedding_colwise"},
                              ["model.embed_tokens", "embedding_colwise"]),
        "all_reduce": ("llama", {f"{layer}.mlp": "all_reduce"}, ["all_reduce"]),
        "local_params": ("llama", {f"{layer}.self_attn": "local_params"}, ["local_params"]),
        "mla": ("llama", {f"{layer}.self_attn.k_proj": "mla_kv_a_proj"}, ["mla_kv_a_proj"]),
        "unknown string": ("llama", {f"{layer}.mlp.up_proj": "diagonal"}, ["'diagonal'"]),
        "no such module": ("llama", {f"{layer}.mlp.w9": "colwise"}, ["mlp.w9", "no module"]),
        "unnamed linear": ("llama", {f"{layer}.mlp.up_proj": None}, ["mlp.up_proj", "not a norm"]),
        "unnamed q norm": ("qwen3", {f"{layer}.self_attn.q_norm": None},
                           ["self_attn.q_norm", "replicated_with_grad_allreduce"]),
        "gathered in a block": ("llama", {f"{layer}.self_attn.q_proj": "colwise_gather_output"},
                                ["self_attn.q_proj", "colwise_gather_output"]),
        "split input": ("llama", {f"{layer}.self_attn.o_proj": "rowwise_split_input"},
                        ["self_attn.o_proj", "rowwise_split_input"]),
        "no plan": ("llama", "empty", ["LlamaForCausalLM", "no tp_plan"]),
        "fused qkv, no tp_size": ("phi3", {}, ["self_attn.qkv_proj", "tp_size"]),
    }
    found = {}
    for case, (family, change, words) in cases.items():
        model = tiny_model(family)
        plan = {} if change == "empty" else {**model.tp_plan, **change}
        model._tp_plan = {k: v for k, v in plan.items() if v is not None}
        try:
            hf_plan(model)
            found[case] = (None, words)
        except ValueError as e:
            found[case] = (str(e), words)
    del transformers
    return found


def test_each_string_it_cannot_carry_out_is_refused_in_one_line_naming_the_entry():
    for case, (message, words) in refusals().items():
        assert_one_line(message, words, case)


def test_a_fused_layout_the_layer_cannot_hold_is_refused_in_one_line():
    import torch.nn as nn

    from tensor_parallel_toy.apply import ColwiseParallel
    from tensor_parallel_toy.apply.plan import resolve_plan

    for sizes in ((8, 3, 1), (6, 6, 2)):  # sums to 12 with odd blocks; sums to 14
        try:
            resolve_plan(nn.Linear(4, 12), ColwiseParallel(output_sizes=sizes), 2)
            message = None
        except ValueError as e:
            message = str(e)
        assert_one_line(message, [f"output_sizes={sizes}", "out_features=12"], str(sizes))


def test_a_norm_over_split_features_that_is_not_a_plain_rms_norm_is_refused_in_one_line():
    """NormOverSplit replaces the norm's forward with weight * x / rms(x) over all features:
    a norm computing anything else (centred, 1 + weight), or features the TP size does not
    divide, is refused naming it; and PyTorch's styles cannot say it (torch_plan)."""
    import torch.nn as nn

    from tensor_parallel_toy.apply import NormOverSplit, torch_plan
    from tensor_parallel_toy.apply.plan import resolve_plan

    gemma_norm = import_transformers().models.gemma3.modeling_gemma3.Gemma3RMSNorm(8)
    cases = {  # case: (the module, p, the words the error names)
        "centred": (nn.LayerNorm(8, bias=False), 2, ["LayerNorm", "rms(x)"]),
        "with a bias": (nn.LayerNorm(8), 2, ["LayerNorm", "'bias'", "one 1-D weight"]),
        "1 + weight": (gemma_norm, 2, ["Gemma3RMSNorm", "rms(x)"]),
        "indivisible": (nn.RMSNorm(6, eps=1e-6), 4, ["features", "6", "4"]),
    }
    for case, (module, p, words) in cases.items():
        try:
            resolve_plan(module, NormOverSplit(), p)
            message = None
        except ValueError as e:
            message = str(e)
        assert_one_line(message, ["NormOverSplit"] + words, case)
    resolve_plan(nn.RMSNorm(8, eps=1e-6), NormOverSplit(), 2)  # the plain one is taken
    try:
        torch_plan({"q_norm": NormOverSplit()})
        message = None
    except ValueError as e:
        message = str(e)
    assert_one_line(message, ["q_norm", "NormOverSplit", "PyTorch"], "torch_plan")
