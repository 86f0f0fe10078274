"""The profile's `hf_dtensor` mode: PyTorch's tensor + sequence parallel plan on a Hugging Face
`LlamaForCausalLM` (`dtensor_tp.parallelize_hf_model`), beside our layers on the same network.

The Hugging Face model is built from a config with the profile model's sizes (nothing is
downloaded), and its weights are the baseline's, `Transformer(config, seed=seed)`, converted
with `to_hf`: every mode starts from the same weights, so every step's loss compares with the
baseline's. A step is the recipe of `dtensor_tp`'s Hugging Face section:

    ids, labels = pad_to_tp_size(ids, labels, p)     # [b, s] -> [b, s'], s' a multiple of p
    loss = hf_loss_and_backward(model, ids, labels)  # loss_parallel on vocab-sharded logits
    reduce_partial_grads(model)                       # the norms' Partial gradients, summed

With `--dp` above 1 the split model is wrapped with FSDP2 over the "dp" dimension of the 2-D
grid, each decoder layer and then the root, as `data_parallel.apply_fsdp` does for ours. Each DP
rank's loss is the mean over its rows; FSDP2 averages the gradients over DP, which is the whole
batch's mean because every row holds the same number of real tokens (no ignored labels in
the profile's data, the padding the same on every row).

`transformers` is imported only when this mode is built.
"""
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from ...config import ModelConfig
from ...interop import dtensor_tp
from ...interop.hf_checkpoint import config_from_hf, to_hf
from ...model import Transformer


def hf_llama_config(config: ModelConfig):
    """The `LlamaConfig` of the same network as `Transformer(config)` (config.mlp "swiglu",
    no q/k/v bias). Raises ValueError if the two would differ in anything."""
    from transformers import LlamaConfig  # only when this mode runs

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_base, tie_word_embeddings=config.tie_embeddings)
    back = config_from_hf(hf_config, config.max_seq_len)
    if back != config:  # e.g. a GELU MLP or a q/k/v bias, which LlamaConfig cannot express
        changed = [k for k in config.__dataclass_fields__ if getattr(back, k) != getattr(config, k)]
        raise ValueError(f"a Hugging Face Llama cannot be this model: it differs in {changed}")
    return hf_config


def build_hf_dtensor(config, seed, tp_group, device, dtype, mesh_2d=None,
                     check_replicated_grads=None):
    """The baseline's weights in a `LlamaForCausalLM`, split over `tp_group` by PyTorch's plan;
    with `mesh_2d` (a ("dp", "tp") DeviceMesh) split over its "tp" dimension and wrapped with
    FSDP2 over its "dp" dimension. Every rank must call it with the same arguments;
    `check_replicated_grads` is `parallelize_hf_model`'s."""
    from transformers import LlamaForCausalLM

    hf_model = LlamaForCausalLM(hf_llama_config(config))
    hf_model.load_state_dict(to_hf(config, Transformer(config, seed=seed).state_dict()),
                             strict=True)
    hf_model.to(device, dtype)
    tp_mesh = (DeviceMesh.from_group(tp_group, device.type) if mesh_2d is None
               else mesh_2d["tp"])
    hf_model = dtensor_tp.parallelize_hf_model(hf_model, tp_mesh,
                                               check_replicated_grads=check_replicated_grads)
    if mesh_2d is not None:
        for layer in hf_model.model.layers:
            fully_shard(layer, mesh=mesh_2d["dp"])
        fully_shard(hf_model, mesh=mesh_2d["dp"])
    return hf_model


def loss_and_backward(hf_model, ids, labels, tp_size):
    """One forward + backward on ids, labels `[b, s]` (labels already shifted); returns the
    mean loss over the real tokens, the padding not counted. The gradients are left reduced."""
    ids, labels = dtensor_tp.pad_to_tp_size(ids, labels, tp_size)
    loss = dtensor_tp.hf_loss_and_backward(hf_model, ids, labels)
    dtensor_tp.reduce_partial_grads(hf_model)
    return loss
