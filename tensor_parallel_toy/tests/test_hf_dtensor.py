"""PyTorch's DTensor plan on Hugging Face models (`parallelize_hf_model`) against the same
models unsharded, for every family it accepts: Llama, Mistral (a sliding window of 4), Qwen2
(q/k/v bias) and Qwen3 (per-head q/k norms, head_dim 24 with hidden 64 and 4 heads).

Each model is tiny and random, built from its config (nothing is downloaded), its norm weights
and biases drawn away from Hugging Face's init so a misplaced one shows. Checked at TP 2 on an
11-token batch (padded to 12): logits, loss and every parameter's full gradient; which
gradients are Partial() before `reduce_partial_grads` (every norm's, Qwen3's q/k norms
included). And what the plan cannot cover is refused in one line on every rank, before any
collective: another model type, a module holding parameters the plan has no entry for.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .helpers import (MODEL_FP32_TOL, assert_errors, assert_one_line, draw_norms_and_biases_,
                      import_transformers, max_rel_error, value_error_messages)

SEQ = 11  # not a multiple of 2: the batch is padded to 12
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24))}


def tiny_hf_model(family, seed=0):
    """The family's random `...ForCausalLM` (fp32, eval mode), the same on every rank."""
    import transformers

    config_cls, model_cls, change = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY, **change})
    model = getattr(transformers, model_cls)(config).eval()
    draw_norms_and_biases_(model)
    return model


def hf_batch(config, seed=3):
    """ids and labels [2, SEQ], a quarter of the labels ignored, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=gen)
    labels = torch.randint(0, config.vocab_size, (2, SEQ), generator=gen)
    labels[torch.rand(2, SEQ, generator=gen) < 0.25] = -100
    return ids, labels


def unsharded_step(model, ids, labels):
    """Hugging Face's own logits and loss (labels already shifted), and its backward."""
    logits = model(ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return logits, loss


def _on_rank_plan_vs_unsharded(family):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial

    from tensor_parallel_toy.interop import dtensor_tp

    group = dist.group.WORLD
    ref, model = tiny_hf_model(family), tiny_hf_model(family)
    dtensor_tp.parallelize_hf_model(model, DeviceMesh.from_group(group, "cpu"),
                                    check_replicated_grads="first")
    ids, labels = hf_batch(ref.config)
    logits_ref, loss_ref = unsharded_step(ref, ids, labels)
    padded_ids, padded_labels = dtensor_tp.pad_to_tp_size(ids, labels, dist.get_world_size())
    loss = dtensor_tp.hf_loss_and_backward(model, padded_ids, padded_labels)
    partial = sorted(n for n, q in model.named_parameters() if isinstance(q.grad, DTensor)
                     and any(isinstance(pl, Partial) for pl in q.grad.placements))
    dtensor_tp.reduce_partial_grads(model)
    with torch.no_grad():
        logits = model(padded_ids, use_cache=False).logits.full_tensor()[:, :SEQ]
    errors = {"logits": max_rel_error(logits, logits_ref), "loss": max_rel_error(loss, loss_ref)}
    grads = dict(model.named_parameters())
    for name, param in ref.named_parameters():
        grad = grads[name].grad  # a plain tensor only if the plan left the parameter out
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        errors["grad:" + name] = max_rel_error(grad, param.grad)
    return {"errors": errors, "partial": partial, "padded": padded_ids.shape[1]}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pytorch_plan_on_each_hugging_face_family_matches_it_unsharded(pools, family):
    import_transformers()
    per_rank = pools(2).run(_on_rank_plan_vs_unsharded, family)
    worst = assert_errors([r["errors"] for r in per_rank], MODEL_FP32_TOL,
                          f"parallelize_hf_model {family} tp=2")
    names = [n for n, _ in tiny_hf_model(family).named_parameters()]
    assert sum(k.startswith("grad:") for k in worst) == len(names), sorted(worst)
    norms = sorted(n for n in names if n.endswith("norm.weight"))  # Qwen3: q_norm, k_norm too
    assert (family == "qwen3") == any("q_norm" in n for n in norms), norms
    for r in per_rank:
        assert r["padded"] == SEQ + 1, r["padded"]
        # Every replicated weight on a part of the data (tokens, or heads) is Partial until
        # reduced: none is left a plain per-rank tensor.
        assert r["partial"] == norms, (r["partial"], norms)


def _on_rank_refusals():
    from torch.distributed.device_mesh import DeviceMesh

    from tensor_parallel_toy.interop import dtensor_tp

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    unknown = tiny_hf_model("llama")
    unknown.config.model_type = "gemma"
    # A Qwen3 model labelled llama: the Llama plan has no entry for its q/k norms.
    relabelled = tiny_hf_model("qwen3")
    relabelled.config.model_type = "llama"
    return value_error_messages({
        "unknown": lambda: dtensor_tp.parallelize_hf_model(unknown, mesh),
        "unplanned": lambda: dtensor_tp.parallelize_hf_model(relabelled, mesh),
        "option": lambda: dtensor_tp.parallelize_hf_model(tiny_hf_model("llama"), mesh,
                                                          check_replicated_grads=0)})


def test_hf_plan_refuses_an_unknown_model_type_and_an_unplanned_module_on_every_rank(pools):
    import_transformers()
    for messages in pools(2).run(_on_rank_refusals):
        assert_one_line(messages["unknown"], ["model_type='gemma'", "'llama'", "'mistral'",
                                              "'qwen2'", "'qwen3'"], "unknown model type")
        assert_one_line(messages["unplanned"], ["model.layers.0.self_attn.q_norm", "weight",
                                                "not covered"], "unplanned module")
        assert_one_line(messages["option"], ["check_replicated_grads=0", "'first'"],
                        "bad guard option")


def test_hf_plan_refuses_what_it_cannot_split():
    from tensor_parallel_toy.interop import dtensor_tp

    import_transformers()
    config = tiny_hf_model("llama").config
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 is not divisible by the "
                                         r"tensor-parallel size 4"):
        dtensor_tp.check_hf_plan(config, 4)
    config.tie_word_embeddings = True
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True"):
        dtensor_tp.check_hf_plan(config, 2)


def test_plan_coverage_names_the_first_uncovered_module_and_reads_patterns():
    """check_plan_covers on its own (no collective): Qwen3 under the Llama plan misses its q/k
    norms; the same entries given as fnmatch patterns, as parallelize_module accepts, cover
    them; a PrepareModuleInput entry alone does not."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    from tensor_parallel_toy.interop import dtensor_tp

    import_transformers()
    model = tiny_hf_model("qwen3")
    config = model.config
    config.model_type = "llama"
    plan = dtensor_tp.dtensor_plan(config)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_norm \(Qwen3RMSNorm, "
                                         r"parameters weight\) is not covered by the plan "
                                         r"\(no entry\)[^\n]*$"):
        dtensor_tp.check_plan_covers(model, plan)
    norms = {f"model.layers.*.self_attn.{n}_norm": SequenceParallel(sequence_dim=2) for n in "qk"}
    dtensor_tp.check_plan_covers(model, {**plan, **norms})
    plan["model.layers.0.self_attn.k_norm"] = PrepareModuleInput()
    with pytest.raises(ValueError, match=r"k_norm [^\n]*\(PrepareModuleInput\)"):
        dtensor_tp.check_plan_covers(model, {**plan, "model.layers.*.self_attn.q_norm":
                                             SequenceParallel(sequence_dim=2)})
