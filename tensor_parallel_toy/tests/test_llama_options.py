"""The Llama-family options of ModelConfig (SwiGLU MLP, q/k/v bias, rope base, norm eps, tied
or untied head) under TP, against the baseline: logits, loss, every gradient, along SGD steps.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tensor_parallel_toy import ModelConfig, Transformer
from tensor_parallel_toy.config import RopeScaling

from .helpers import assert_matches_baseline, assert_one_line, compare_on_world, max_rel_error

# 12 query heads of head_dim 4, ffn 96: divisible by TP 2 and 4.
LLAMA = ModelConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=12,
                    ffn_hidden_size=96, max_seq_len=32, mlp="swiglu", qkv_bias=True,
                    rope_base=500000.0, norm_eps=1e-6)

# (name, config changes, tp, overlap): k/v heads fused with q (multi-head), split (GQA, kv >= tp)
# and shared (kv < tp: the shared k/v rows of weight and bias summed by copy_to_row_holders).
CASES = [
    ("mha", {}, 2, False),
    ("mha", {}, 4, True),
    ("gqa-split", dict(num_kv_heads=4), 2, True),
    ("gqa-split", dict(num_kv_heads=4), 4, False),
    ("gqa-shared", dict(num_kv_heads=2), 4, True),
    ("tied-no-bias", dict(tie_embeddings=True, qkv_bias=False, num_kv_heads=4), 2, False),
    # Every checkpoint option at once (Qwen3's q/k norms with k/v heads shared, a head size
    # not hidden/heads, Llama 3's rope scaling, a window shorter than the sequence of 12): the
    # grad norm must count the q/k norms once, and SGD must keep their replicas equal.
    ("qk-norm-head-dim-llama3-window",
     dict(qk_norm=True, head_dim=6, num_kv_heads=2, sliding_window=5,
          rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)), 4, True),
]


@pytest.mark.parametrize("name,change,tp,overlap", CASES, ids=[
    f"{n}-tp{tp}-{'overlap' if o else 'basic'}" for n, _, tp, o in CASES])
def test_swiglu_and_qkv_bias_model_matches_baseline(pools, name, change, tp, overlap):
    config = dataclasses.replace(LLAMA, **change)
    per_rank = pools(tp).run(compare_on_world, config, overlap=overlap)
    assert_matches_baseline(per_rank, config, f"{name} tp={tp} overlap={overlap}")


def test_swiglu_baseline_is_down_of_silu_gate_times_up():
    """The fused [2f, h] weight is gate (its first f rows) then up: checked against the
    formula written out with separate weights."""
    model = Transformer(LLAMA, seed=1)
    mlp, x = model.layers[0].mlp, torch.randn(5, 2, LLAMA.hidden_size)
    gate, up = mlp.gate_up.weight.chunk(2)
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), mlp.down.weight)
    err = max_rel_error(mlp(x), want)
    assert err <= 1e-6, f"SwiGLU vs its formula: {err:.3g}"


def test_qkv_bias_is_applied_and_trained():
    model = Transformer(LLAMA, seed=1)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.attn.qkv.bias" in names and "layers.0.attn.proj.bias" not in names, names
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(0))
    before = model(ids)
    with torch.no_grad():
        model.layers[0].attn.qkv.bias.add_(1.0)
    assert max_rel_error(model(ids), before) > 1e-3, "changing the q/k/v bias changed nothing"


@pytest.mark.parametrize("change, words", [
    (dict(mlp="relu"), ["mlp='relu'", "gelu", "swiglu"]),
    (dict(qkv_bias=1), ["qkv_bias=1", "bool"]),
    (dict(norm_eps=0.0), ["norm_eps=0.0", "positive"]),
    (dict(rope_base=-1.0), ["rope_base=-1.0", "positive"]),
    (dict(head_dim=5), ["head_dim=5", "even"]),
    (dict(hidden_size=50, head_dim=None), ["hidden_size=50", "num_heads=12", "head_dim"]),
    (dict(sliding_window=0), ["sliding_window=0", "positive"]),
    (dict(qk_norm="yes"), ["qk_norm='yes'", "bool"]),
    (dict(rope_scaling=dict(factor=8.0)), ["rope_scaling=", "RopeScaling"]),
])
def test_bad_llama_options_raise_one_line_naming_the_field(change, words):
    with pytest.raises(ValueError) as info:
        dataclasses.replace(LLAMA, **change)
    assert_one_line(str(info.value), words, str(change))


@pytest.mark.parametrize("args, words", [
    (("yarn", 4.0), ["kind='yarn'", "'linear'", "'llama3'"]),
    (("linear", 0.0), ["factor=0.0", "positive"]),
    (("llama3", 8.0, 4.0, 1.0), ["high_freq_factor=1.0", "low_freq_factor=4.0"]),
    (("llama3", 8.0, 1.0, 4.0, 0), ["original_max_seq_len=0", "positive"]),
])
def test_bad_rope_scaling_raises_one_line_naming_the_field(args, words):
    with pytest.raises(ValueError) as info:
        RopeScaling(*args)
    assert_one_line(str(info.value), words, str(args))
