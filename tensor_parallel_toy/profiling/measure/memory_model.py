"""Activation memory per rank, tensor by tensor: what one block saves for its backward pass.

This is the table of the blog's section 2 ("Activation memory per rank") as code. For the
package's block (RMSNorm, multi-head attention through `scaled_dot_product_attention`, a GELU
MLP, residuals) with `p` TP ranks, each rank's autograd keeps, in elements:

    TP + SP:   (6·sbh + 6·sbh + 2·sbf + sba + 2·sb) / p
    TP alone:  6·sbh + 2·sb + (6·sbh + 2·sbf + sba) / p

The first `6·sbh + 2·sb` are the two norms' tensors (input, normalised input, output = the
column layer's input, and `rms`): on every token, so split along the sequence under SP and
full size on every rank without it. The rest lives inside attention and the MLP, on this
rank's heads and MLP features: divided by `p` either way.

The count is exact for fp32 (`bytes_per_element=4`): tests/test_concepts.py matches every
tensor listed here to a storage autograd saves. In bf16 some tensors are kept in fp32 instead:
each RMSNorm upcasts its input twice and keeps both fp32 copies, and its `rms`; the loss keeps
an fp32 softmax. `bf16_extra_bytes` counts them, and a test checks that the bf16 baseline saves
the count at `bytes_per_element=2` plus that (the rotary embedding, which also computes in
fp32, saves only its cos/sin tables).
"""
from ..spec import MODEL_DEFAULTS, SEQ, ProfileSpec
from .metrics import MiB

SEQUENCE_PARALLEL = "sequence-parallel"  # this rank's s/p tokens (TP + SP)
REPLICATED = "replicated"  # the full sequence on every rank (TP alone)
TENSOR_PARALLEL = "tensor-parallel"  # this rank's heads or MLP features


def _check_sizes(s, b, h, f, a, p, sequence_parallel):
    for name, value in (("s", s), ("b", b), ("h", h), ("f", f), ("a", a), ("p", p)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    split = {"h": h, "f": f, "a": a} | ({"s": s} if sequence_parallel else {})
    for name, value in split.items():
        if value % p:
            raise ValueError(f"{name}={value} is not divisible by p={p}; each rank must hold "
                             f"an equal share of it")


def block_saved_elements(s, b, h, f, a, p, sequence_parallel=True):
    """[(label, region, elements)] one transformer block keeps for backward, on one rank.

    s: sequence length, b: micro-batch, h: hidden size, f: MLP hidden size, a: attention heads,
    p: TP size (1: one device). region: "sequence-parallel" (TP + SP: this rank's s/p tokens)
    or "replicated" (TP alone: the full sequence on every rank) for the norms' tensors, and
    "tensor-parallel" (this rank's a/p heads or f/p features) for the rest. Each storage is
    listed once: the norm's output *is* the column layer's saved input, attention's output
    *is* `proj`'s input.
    """
    _check_sizes(s, b, h, f, a, p, sequence_parallel)
    norm_region = SEQUENCE_PARALLEL if sequence_parallel else REPLICATED
    n = s * b // p if sequence_parallel else s * b  # tokens this rank normalises
    rows = []
    for norm, column in (("attn_norm", "qkv"), ("mlp_norm", "fc1")):
        rows += [(f"{norm} input x", norm_region, n * h),
                 (f"{norm} x·rms", norm_region, n * h),
                 (f"{norm} output = {column} input", norm_region, n * h),
                 (f"{norm} rms", norm_region, n)]
    sb = s * b
    rows += [("qkv output (q, k, v)", TENSOR_PARALLEL, 3 * sb * h // p),
             ("rotated q", TENSOR_PARALLEL, sb * h // p),
             ("rotated k", TENSOR_PARALLEL, sb * h // p),
             ("attention output = proj input", TENSOR_PARALLEL, sb * h // p),
             ("attention log-sum-exp", TENSOR_PARALLEL, sb * a // p),
             ("fc1 output = GELU input", TENSOR_PARALLEL, sb * f // p),
             ("GELU output = fc2 input", TENSOR_PARALLEL, sb * f // p)]
    return rows


def model_saved_elements(config, s, b, p, sequence_parallel=True):
    """[(label, region, elements)] the whole `Transformer(config)` keeps on one rank for one
    forward + backward of a loss: its `num_layers` blocks (labels prefixed "layer i: "), the
    final norm and the loss's softmax.

    sequence_parallel=True: `Transformer(config, tp_group)` with p ranks, where the final norm
    works on s/p tokens and the vocab-parallel loss keeps this rank's `[s, b, V/p]` softmax.
    sequence_parallel=False: the baseline `Transformer(config)` whose blocks
    `classic_tp.apply_tensor_parallel` split; it splits the blocks only, so the final norm,
    the head and `F.cross_entropy` keep their single-device `[s, b, h]` and `[s·b, V]` tensors.
    Token ids, labels, masks and rotary tables (tens of KiB) are not counted.
    """
    if config.mlp != "gelu" or config.num_kv_heads != config.num_heads:
        raise ValueError(f"the memory model covers the GELU MLP with multi-head attention; "
                         f"got mlp={config.mlp!r}, num_kv_heads={config.num_kv_heads} "
                         f"(num_heads={config.num_heads})")
    h, v = config.hidden_size, config.vocab_size
    block = block_saved_elements(s, b, h, config.ffn_hidden_size, config.num_heads, p,
                                 sequence_parallel)
    rows = [(f"layer {i}: {label}", region, n)
            for i in range(config.num_layers) for label, region, n in block]
    split = p if sequence_parallel else 1
    region = SEQUENCE_PARALLEL if sequence_parallel else REPLICATED
    rows += [("final norm input x", region, s * b * h // split),
             ("final norm x·rms", region, s * b * h // split),
             ("final norm output = head input", region, s * b * h // split),
             ("final norm rms", region, s * b // split),
             ("loss softmax", TENSOR_PARALLEL if sequence_parallel else REPLICATED,
              s * b * v // split)]
    return rows


def model_saved_bytes(config, s, b, p, sequence_parallel=True, bytes_per_element=4):
    """Bytes one rank keeps for backward: the sum of `model_saved_elements` (see there)."""
    return bytes_per_element * sum(n for _, _, n in model_saved_elements(
        config, s, b, p, sequence_parallel))


def bf16_extra_bytes(config, s, b):
    """Bytes a bf16 `Transformer(config)` on one device saves beyond `model_saved_bytes(config,
    s, b, 1, bytes_per_element=2)`. Each of the 2L + 1 RMSNorms computes `x.float()` twice (for
    the mean of squares and for `x·rms`), and autograd keeps both fp32 copies where the count
    has one bf16 input: +6 bytes per element; its `rms` is fp32: +2 bytes per token. The loss
    keeps its softmax in fp32: +2 bytes per logit."""
    norms = 2 * config.num_layers + 1
    n = s * b
    return norms * (6 * n * config.hidden_size + 2 * n) + 2 * n * config.vocab_size


def block_mib(s, b, h, f, a, p, sequence_parallel=True, bytes_per_element=4):
    return bytes_per_element * sum(
        n for _, _, n in block_saved_elements(s, b, h, f, a, p, sequence_parallel)) / MiB


def profile_shape():
    """The profile's default model and batch, as the sizes the functions above take."""
    spec = ProfileSpec()
    return {"s": SEQ, "b": spec.batch, "h": MODEL_DEFAULTS["hidden_size"],
            "f": MODEL_DEFAULTS["ffn_hidden_size"], "a": MODEL_DEFAULTS["num_heads"],
            "p": spec.tp}


def profile_block_mib():
    """MiB one block keeps per rank at the profile's default shape, as the blog quotes them:
    {"one device": ..., "TP alone": ..., "TP + SP": ...} (fp32)."""
    shape = profile_shape()
    return {"one device": block_mib(**shape | {"p": 1}),
            "TP alone": block_mib(**shape, sequence_parallel=False),
            "TP + SP": block_mib(**shape)}
