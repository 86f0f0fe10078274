"""Hugging Face Llama, Mistral, Qwen2 and Qwen3 checkpoints <-> this package's `Transformer`.

    config, state_dict = from_hf(hf_model)             # or from_hf(hf_config, hf_state_dict)
    model = Transformer(config); model.load_state_dict(state_dict)            # the baseline
    tp = Transformer(config, tp_group=g); load_full_state_dict(tp, state_dict)  # or split
    hf_state_dict = to_hf(config, full_state_dict(tp))                       # and back

The architectures are the same network: pre-norm RMSNorm blocks, rotary embeddings, grouped-query
attention without bias on the output projection, and a SwiGLU MLP. Only the weights' names and
layouts differ:

    Hugging Face                                  here
    model.embed_tokens.weight                     embed.weight
    layers.i.input_layernorm.weight               layers.i.attn_norm.weight
    layers.i.self_attn.{q,k,v}_proj.{weight,bias}  layers.i.attn.qkv.{weight,bias}, rows
                                                  [kv heads, (g q heads, k, v), head_dim]
                                                  (g = num_heads / num_kv_heads)
    layers.i.self_attn.o_proj.weight              layers.i.attn.proj.weight
    layers.i.self_attn.{q,k}_norm.weight          layers.i.attn.{q,k}_norm.weight (Qwen3)
    layers.i.post_attention_layernorm.weight      layers.i.mlp_norm.weight
    layers.i.mlp.{gate,up}_proj.weight            layers.i.mlp.gate_up.weight [2f, h] (gate, up)
    layers.i.mlp.down_proj.weight                 layers.i.mlp.down.weight
    model.norm.weight, lm_head.weight             norm.weight, head.weight

Rotary embeddings need no conversion. Both rotate the pair (x[j], x[j + hd/2]) of each head by
position * base^(-2j/hd), Hugging Face's `rotate_half` form: checkpoints converted from Meta's
interleaved-pair layout already have their q/k rows permuted into it, and this model's
`rotary.rotate` uses the same halves, so q and k rows are copied as they are. Llama 3's and
linear rope scaling become a `RopeScaling`; the other rope types are refused.

Any vocabulary size converts as it is: a TP model pads one the TP size does not divide (a Llama 2
fine-tune's 32001) in its own shards, and its full state dict and gradients, hence `to_hf`,
have the checkpoint's `[V, h]`.

What differs between the families is configuration, not layout: Qwen2 has a q/k/v bias; Qwen3
has none but normalises each head's q and k (`qk_norm`), and sets its own head_dim; Mistral
v0.1 attends within a sliding window (as Qwen2/Qwen3 may, when every layer does).

`transformers` is imported only inside `from_hf` when it is given a model object, never at
import time: the rest of the package does not need it. Nothing is downloaded here; load a
checkpoint yourself (`AutoModelForCausalLM.from_pretrained(path)`) and pass the model.
"""
import torch

from ..config import ModelConfig, RopeScaling

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


def _refuse(field, value, why):
    raise ValueError(f"Hugging Face config {field}={value!r}: {why}")


def _rope_from_hf(get):
    """(rope_base, RopeScaling or None) from `rope_parameters` (transformers >= 5) or the
    legacy `rope_scaling` dict with a top-level `rope_theta`."""
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    field = "rope_parameters" if get("rope_parameters") else "rope_scaling"
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        _refuse(f"{field}['rope_type']", kind, f"supported rope types are {ROPE_TYPES}")
    if rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse("partial_rotary_factor", rope.get("partial_rotary_factor",
                                                  get("partial_rotary_factor")),
                "only rotating every feature of a head (1.0) is modelled")
    base = float(rope.get("rope_theta") or get("rope_theta") or 10000.0)
    if kind == "default":
        return base, None

    def need(key):
        if key not in rope:
            _refuse(field, rope, f"rope type {kind!r} needs {key!r}")
        return float(rope[key])

    if kind == "linear":
        return base, RopeScaling("linear", need("factor"))
    original = (get("original_max_position_embeddings")  # where transformers reads it first
                or rope.get("original_max_position_embeddings")
                or get("max_position_embeddings"))
    return base, RopeScaling("llama3", need("factor"), need("low_freq_factor"),
                             need("high_freq_factor"), int(original))


def _window_from_hf(family, get):
    """The sliding window every layer uses, or None; a mix of windowed and full layers is
    refused. Mistral windows every layer when `sliding_window` is set; Qwen2/Qwen3 window
    the layers `layer_types` marks "sliding_attention" (with use_sliding_window, the layers
    from max_window_layers on), and have already set `sliding_window` None without it."""
    layer_types = set(get("layer_types") or ["full_attention"])
    if family == "mistral":
        if layer_types != {"full_attention"}:
            _refuse("layer_types", sorted(layer_types), "Mistral windows every layer by "
                    "sliding_window; per-layer types are Ministral's, not modelled")
        return get("sliding_window")
    if not layer_types <= {"full_attention", "sliding_attention"}:
        _refuse("layer_types", sorted(layer_types), "modelled layer types are "
                                                    "'full_attention' and 'sliding_attention'")
    if len(layer_types) > 1:  # one mask serves every layer here
        _refuse("layer_types", get("layer_types"), f"a mix of windowed and full layers "
                f"(max_window_layers={get('max_window_layers')!r}) is not modelled: every "
                f"layer must be 'full_attention' or every one 'sliding_attention'")
    return get("sliding_window") if layer_types == {"sliding_attention"} else None


def config_from_hf(hf_config, max_seq_len=None) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama/Mistral/Qwen2/Qwen3 config; anything this model
    cannot express is refused with one line naming the field."""
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        _refuse("model_type", family, f"supported families are {FAMILIES}")
    get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if get("hidden_act") != "silu":
        _refuse("hidden_act", get("hidden_act"), "only 'silu' (SwiGLU) is modelled")
    rope_base, rope_scaling = _rope_from_hf(get)
    if get("attention_bias", False):
        _refuse("attention_bias", True, "a bias on o_proj is not modelled (Qwen2's q/k/v-only "
                                        "bias is)")
    if get("mlp_bias", False):
        _refuse("mlp_bias", True, "MLP biases are not modelled")
    if get("attention_dropout", 0.0):
        _refuse("attention_dropout", get("attention_dropout"), "this model has no dropout")
    return ModelConfig(
        vocab_size=get("vocab_size"), hidden_size=hidden, num_layers=get("num_hidden_layers"),
        num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
        ffn_hidden_size=get("intermediate_size"),
        max_seq_len=max_seq_len or get("max_position_embeddings"),
        norm_eps=float(get("rms_norm_eps")), rope_base=rope_base, rope_scaling=rope_scaling,
        tie_embeddings=bool(get("tie_word_embeddings", False)), mlp="swiglu",
        qkv_bias=family == "qwen2", head_dim=get("head_dim") or hidden // heads,
        qk_norm=family == "qwen3", sliding_window=_window_from_hf(family, get))


def _layer_names(i):
    """(our prefix, Hugging Face prefix) of block i: ours first, as in every pair here."""
    return f"layers.{i}.", f"model.layers.{i}."


# Tensors that only change their name: (ours, Hugging Face's); the per-block ones under the
# prefixes of `_layer_names`. The fused ones (q/k/v, gate/up) are converted in code.
_RENAMED = (("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"))
_RENAMED_PER_BLOCK = (("attn_norm.weight", "input_layernorm.weight"),
                      ("mlp_norm.weight", "post_attention_layernorm.weight"),
                      ("attn.proj.weight", "self_attn.o_proj.weight"),
                      ("mlp.down.weight", "mlp.down_proj.weight"))


_QK_NORMS = (("attn.q_norm.weight", "self_attn.q_norm.weight"),
             ("attn.k_norm.weight", "self_attn.k_norm.weight"))


def _renamed(config):
    """(our key, Hugging Face's key) of every tensor that only changes its name."""
    pairs = list(_RENAMED)
    per_block = _RENAMED_PER_BLOCK + (_QK_NORMS if config.qk_norm else ())
    for i in range(config.num_layers):
        ours, theirs = _layer_names(i)
        pairs += [(ours + a, theirs + b) for a, b in per_block]
    return pairs


def _qkv_suffixes(config):
    return ("weight", "bias") if config.qkv_bias else ("weight",)


def _group_heads(q, k, v, num_kv_heads):
    """q `[nh * d, ...]`, k and v `[nkv * d, ...]` -> one tensor, rows `[nkv, (g q heads, k, v),
    d]`: each k/v head after the g query heads that read it."""
    return torch.cat([t.unflatten(0, (num_kv_heads, -1)) for t in (q, k, v)], dim=1).flatten(0, 1)


def _ungroup_heads(qkv, num_kv_heads, g):
    """The inverse of `_group_heads`: q, k and v, each in its own storage."""
    grouped = qkv.unflatten(0, (num_kv_heads, g + 2, -1))
    return [t.flatten(0, 2).contiguous() for t in grouped.split([g, 1, 1], dim=1)]


def state_dict_from_hf(config: ModelConfig, hf_state_dict):
    """Hugging Face tensors -> a baseline `Transformer(config)` state dict (same tensors,
    re-laid out; nothing is cast)."""
    hf = hf_state_dict
    out = {ours: hf[theirs] for ours, theirs in _renamed(config)}
    out["head.weight"] = out["embed.weight"] if config.tie_embeddings else hf["lm_head.weight"]
    for i in range(config.num_layers):
        ours, theirs = _layer_names(i)
        for sfx in _qkv_suffixes(config):
            q, k, v = (hf[f"{theirs}self_attn.{x}_proj.{sfx}"] for x in "qkv")
            out[f"{ours}attn.qkv.{sfx}"] = _group_heads(q, k, v, config.num_kv_heads)
        out[ours + "mlp.gate_up.weight"] = torch.cat([hf[theirs + "mlp.gate_proj.weight"],
                                                      hf[theirs + "mlp.up_proj.weight"]])
    return out


def from_hf(hf_model_or_config, hf_state_dict=None, *, max_seq_len=None):
    """`(ModelConfig, baseline state dict)` from a Hugging Face `...ForCausalLM` model, or from
    its config and state dict. `max_seq_len` (default: the config's max_position_embeddings)
    sizes the rotary tables; lower it for a long-context checkpoint used on short sequences."""
    if hf_state_dict is None:
        from transformers import PreTrainedModel  # only when a model object is given

        if not isinstance(hf_model_or_config, PreTrainedModel):
            raise ValueError(f"from_hf got a {type(hf_model_or_config).__name__}: pass a "
                             f"Hugging Face model, or its config and its state dict")
        hf_state_dict = hf_model_or_config.state_dict()
        hf_model_or_config = hf_model_or_config.config
    config = config_from_hf(hf_model_or_config, max_seq_len)
    return config, state_dict_from_hf(config, hf_state_dict)


def to_hf(config: ModelConfig, state_dict):
    """A baseline state dict (or `full_state_dict()` / `full_grads()` of a split model) ->
    the same tensors under Hugging Face's names and layouts. A tied head's `lm_head.weight` is
    the embedding's tensor, as in Hugging Face's own state dict."""
    if config.mlp != "swiglu":
        raise ValueError(f"mlp={config.mlp!r}: Hugging Face Llama/Mistral/Qwen use 'swiglu'")
    sd = state_dict
    out = {theirs: sd[ours] for ours, theirs in _renamed(config)}
    out["lm_head.weight"] = sd["embed.weight"] if config.tie_embeddings else sd["head.weight"]
    nkv, g = config.num_kv_heads, config.num_heads // config.num_kv_heads
    for i in range(config.num_layers):
        ours, theirs = _layer_names(i)
        for sfx in _qkv_suffixes(config):
            q, k, v = _ungroup_heads(sd[f"{ours}attn.qkv.{sfx}"], nkv, g)
            for name, t in zip("qkv", (q, k, v)):
                out[f"{theirs}self_attn.{name}_proj.{sfx}"] = t
        gate, up = (t.clone() for t in sd[ours + "mlp.gate_up.weight"].chunk(2))  # own storage
        out[theirs + "mlp.gate_proj.weight"], out[theirs + "mlp.up_proj.weight"] = gate, up
    return out


__all__ = ["config_from_hf", "from_hf", "state_dict_from_hf", "to_hf"]
