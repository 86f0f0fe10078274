"""Hugging Face Llama and Qwen2 models, converted with from_hf, against `transformers` itself.

The models are tiny and random, built from config objects (nothing is downloaded): hidden 64,
2 layers, 4 query heads, 2 k/v heads, vocabulary 128. Their norm weights and q/k/v biases are
drawn away from Hugging Face's init (ones, zeros), so a norm or bias mapped to the wrong place
shows. Checked: the conversion round-trips exactly; our baseline's logits are Hugging Face's;
our TP model at TP 2 and 4, overlap on and off, matches Hugging Face in logits, loss and every
parameter gradient (ours converted back with to_hf, compared under Hugging Face's names), and
its weights gathered and converted back (`to_hf(full_state_dict(tp))`) are Hugging Face's, in
their shapes: also with a vocabulary of 101 (Llama 2's 32001 in small), which TP 2 pads to 102.

Without `transformers` these tests fail, naming the reason: it is a pinned requirement.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensor_parallel_toy import Transformer, from_hf, guard, to_hf
from tensor_parallel_toy.support.sharding import full_grads, full_state_dict, load_full_state_dict
from tensor_parallel_toy.interop.hf_checkpoint import config_from_hf

from .helpers import (MODEL_FP32_TOL, assert_errors, assert_one_line, draw_norms_and_biases_,
                      import_transformers, max_rel_error, random_batch, value_error_messages)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
SEQ = 11  # not a multiple of 2 or 4: the TP model pads it


def tiny_hf_model(family, seed=0, **change):
    """A random `LlamaForCausalLM` or `Qwen2ForCausalLM` (fp32, eval mode), the same on
    every rank."""
    transformers = import_transformers()
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **change})).eval()
    draw_norms_and_biases_(model)
    return model


def _hf_step(hf, ids, labels):
    """Hugging Face's logits and loss (labels already shifted, as ours take them), backward."""
    logits = hf(ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return logits, loss


def _hf_reference(family, change):
    """In the pytest process: the converted model, a batch, and Hugging Face's logits, loss and
    gradients on it. The ranks get these, so they never import transformers themselves."""
    hf = tiny_hf_model(family, **change)
    config, state = from_hf(hf)
    ids, labels = random_batch(config, 2, SEQ, seed=3, ignore_frac=0.25)
    logits, loss = _hf_step(hf, ids, labels)
    expected = {"logits": logits.detach(), "loss": loss.detach(),
                **{"grad:" + n: q.grad for n, q in hf.named_parameters()},
                **{"weight:" + n: q.detach() for n, q in hf.named_parameters()}}
    return config, state, ids, labels, expected


def _on_rank_tp_vs_hf(config, state, ids, labels, expected, overlap):
    """Our TP model over WORLD, loaded from the converted Hugging Face weights, against
    Hugging Face's results; gradients compared under Hugging Face's names."""
    tp = guard(Transformer(config, tp_group=dist.group.WORLD, overlap=overlap, seed=5))
    load_full_state_dict(tp, state)
    loss = tp.loss(ids, labels)
    loss.backward()
    got = {"logits": tp(ids), "loss": loss}
    got.update({"grad:" + n: g for n, g in to_hf(config, full_grads(tp)).items()})
    got.update({"weight:" + n: w for n, w in to_hf(config, full_state_dict(tp)).items()})
    return {k: max_rel_error(got[k], want) for k, want in expected.items()}


def _on_rank_hf_door_refusals(config, state, ids, labels):
    """A checkpoint's door: from_hf's config and weights, the model guarded as users guard it;
    what one device refuses (an id past the vocabulary) and what would be a number of no batch
    (rank 1 fed another batch) raise on every rank."""
    tp = guard(Transformer(config, tp_group=dist.group.WORLD))
    load_full_state_dict(tp, state)
    bad = ids.clone()
    bad[0, 2] = config.vocab_size
    other = ids.flip(1) if dist.get_rank() == 1 else ids
    return value_error_messages({"id": lambda: tp.loss(bad, labels),
                                 "batch": lambda: tp.loss(other, labels)})


def test_a_hugging_face_checkpoint_is_guarded_like_every_door(pools):
    config, state, ids, labels, _ = _hf_reference("llama", {})
    for rank, messages in enumerate(pools(2).run(_on_rank_hf_door_refusals, config, state, ids,
                                                 labels)):
        assert_one_line(messages["id"], [f"token id {config.vocab_size} is out of range"],
                        f"rank {rank}, id")
        assert_one_line(messages["batch"], ["different input_ids"], f"rank {rank}, batch")


CASES = [("llama", 2, False, {}), ("llama", 2, True, {}), ("llama", 4, False, {}),
         ("llama", 4, True, {}), ("qwen2", 2, False, {}), ("qwen2", 2, True, {}),
         ("qwen2", 4, False, {}), ("qwen2", 4, True, {}),
         ("llama", 2, True, dict(num_key_value_heads=4, tie_word_embeddings=True)),
         ("llama", 2, False, dict(vocab_size=101, hidden_size=32))]  # padded to 102


@pytest.mark.parametrize("family,tp,overlap,change", CASES, ids=[
    f"{f}-tp{tp}-{'overlap' if o else 'basic'}"
    + ("-vocab101" if "vocab_size" in c else "-mha-tied" if c else "") for f, tp, o, c in CASES])
def test_tp_model_matches_hugging_face_logits_loss_and_every_gradient(pools, family, tp,
                                                                      overlap, change):
    config, state, ids, labels, expected = _hf_reference(family, change)
    n_grads = sum(k.startswith("grad:") for k in expected)
    per_rank = pools(tp).run(_on_rank_tp_vs_hf, config, state, ids, labels,
                             expected, overlap)
    worst = assert_errors(per_rank, MODEL_FP32_TOL, f"{family} tp={tp} overlap={overlap}")
    assert sum(k.startswith("grad:") for k in worst) == n_grads > 0, sorted(worst)
    assert sum(k.startswith("weight:") for k in worst) == n_grads, sorted(worst)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_heads,tied", [(2, False), (4, True)], ids=["gqa", "mha-tied"])
def test_round_trip_is_exact_and_baseline_logits_match(family, kv_heads, tied):
    hf = tiny_hf_model(family, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    config, state = from_hf(hf)
    assert config.qkv_bias == (family == "qwen2") and config.mlp == "swiglu", config
    base = Transformer(config)
    base.load_state_dict(state)  # strict: every key there, none left over
    back, want = to_hf(config, base.state_dict()), hf.state_dict()
    assert sorted(back) == sorted(want), set(back) ^ set(want)
    changed = [k for k in want if not torch.equal(back[k], want[k])]
    assert not changed, f"not bit-exact after from_hf -> to_hf: {changed}"
    ids, labels = random_batch(config, 2, SEQ, seed=1)
    logits_hf, loss_hf = _hf_step(hf, ids, labels)
    loss = F.cross_entropy(base(ids).flatten(0, 1), labels.flatten())
    loss.backward()
    errors = {"logits": max_rel_error(base(ids), logits_hf), "loss": max_rel_error(loss, loss_hf)}
    grads = to_hf(config, {n: p.grad for n, p in base.named_parameters()})
    errors.update({"grad:" + n: max_rel_error(grads[n], p.grad) for n, p in hf.named_parameters()})
    assert_errors([errors], MODEL_FP32_TOL, f"{family} baseline vs Hugging Face")


@pytest.mark.parametrize("family, field, value, words", [
    ("llama", "hidden_act", "gelu", ["hidden_act='gelu'", "silu"]),
    ("llama", "attention_bias", True, ["attention_bias=True", "o_proj"]),
    ("llama", "mlp_bias", True, ["mlp_bias=True"]),
    ("llama", "rope_parameters", {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4},
     ["rope_parameters['rope_type']='yarn'", "'default'", "'linear'", "'llama3'"]),
    ("llama", "partial_rotary_factor", 0.5, ["partial_rotary_factor=0.5", "1.0"]),
    ("llama", "rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4},
     ["rope_parameters=", "'llama3' needs 'low_freq_factor'"]),
    ("llama", "attention_dropout", 0.1, ["attention_dropout=0.1"]),
    ("qwen2", "layer_types", ["full_attention", "sliding_attention"],
     ["layer_types=", "max_window_layers=", "every"]),
    ("qwen2", "layer_types", ["chunked_attention"] * 2,
     ["'chunked_attention'", "'full_attention'"]),
    ("llama", "model_type", "gemma", ["model_type='gemma'", "llama"]),
])
def test_what_the_model_cannot_express_is_refused_naming_the_field(family, field, value, words):
    config = tiny_hf_model(family).config
    setattr(config, field, value)
    with pytest.raises(ValueError) as info:
        config_from_hf(config)
    assert_one_line(str(info.value), words, f"{field}={value!r}")


def test_sliding_windows_convert_as_transformers_applies_them():
    """Mistral windows every layer when sliding_window is set; Qwen2 only with
    use_sliding_window, and then the layers from max_window_layers on (all of them here)."""
    transformers = import_transformers()
    windows = {
        "mistral": transformers.MistralConfig(**TINY, sliding_window=16),
        "mistral-none": transformers.MistralConfig(**TINY, sliding_window=None),
        "qwen2-unused": transformers.Qwen2Config(**TINY, sliding_window=16),
        "qwen2-all": transformers.Qwen2Config(**TINY, sliding_window=16, use_sliding_window=True,
                                              max_window_layers=0),
        "qwen2-none-reached": transformers.Qwen2Config(**TINY, sliding_window=16,
                                                       use_sliding_window=True),
    }
    got = {k: config_from_hf(c).sliding_window for k, c in windows.items()}
    assert got == {"mistral": 16, "mistral-none": None, "qwen2-unused": None, "qwen2-all": 16,
                   "qwen2-none-reached": None}, got
