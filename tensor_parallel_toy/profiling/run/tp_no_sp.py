"""Classic TP without sequence parallelism, measured once: what it saves for backward.

Sequence parallelism splits the activations *between* the tensor-parallel layers (the norms'
inputs, the residual stream) over the ranks; classic TP keeps them whole on every rank and
splits only what lives inside attention and the MLP. To put a measured number on the
difference, the profile converts the baseline Transformer with `apply_tensor_parallel` and runs
one training step (`train.train_step`) with the meters of the training modes: activations saved
for backward, parameters, gradients, optimizer state. It is not a training mode and is not
timed.

The model's Attention and MLP classes do not declare their column and row layers (under SP
they are built parallel from the start), so each block's two are declared here, on the
modules themselves. The same step of the baseline runs beside it, on the same batch and weights:
its loss must come out the same, or this would not be the same model split another way.

Per rank, with classic TP over p ranks (s, b: the batch; h, f: hidden and MLP sizes; V: the
vocabulary):
    between the layers  [s, b, h]   whole on every rank (under SP: [s/p, b, h])
    inside attention    q, k, v, scores, output of the heads: [..., h/p] or heads/p
    inside the MLP      [s, b, f/p] before and after the activation
    head and loss       [s, b, V]   whole: only the blocks are converted, so the embedding, the
                                    head and the loss stay as the baseline's (under the
                                    package's TP: vocabulary-parallel, [s, b, V/p])
The difference to the `tp` mode is therefore sequence parallelism plus the vocabulary split.
"""
import torch.distributed as dist

from ...apply.classic_tp import apply_tensor_parallel
from ...launcher.initialize import current_device
from ..measure.metrics import SavedActivationBytes
from . import data
from .train import build_model, make_optimizer, train_step

# The loss of the one step may differ from the baseline's by round-off only (the all-reduce
# adds the ranks' partial sums in another order); anything larger is a different model.
SAME_LOSS_TOL = {"fp32": 1e-5, "bf16": 5e-3}


def unsupported(config, p):
    """Why this config cannot be split by classic TP here, or None."""
    if config.mlp != "gelu":
        return (f"mlp={config.mlp!r}: its gate and up rows are one nn.Linear, gate then up, "
                f"and apply_tensor_parallel's contiguous row shard would hold gate rows only")
    if config.num_kv_heads != config.num_heads and config.num_kv_heads % p:
        return (f"num_kv_heads={config.num_kv_heads} does not split over {p} ranks: classic TP "
                f"needs whole k/v heads on every rank")
    return None


def classic_tp_model(model, tp_group):
    """The baseline `model`, its blocks' attention and MLP converted in place by
    `apply_tensor_parallel`; the embedding, the norms and the head stay whole (replicated)."""
    for block in model.layers:
        # qkv's rows are laid out k/v head by k/v head, each after its query heads: row
        # shards hold whole groups (with num_kv_heads % p == 0, see `unsupported`).
        block.attn.tp_column = "qkv"
        block.attn.tp_row = "proj"
        block.mlp.tp_column, block.mlp.tp_row = "fc1", "fc2"
    return apply_tensor_parallel(model, tp_group)


def measure(spec):
    """On every rank: step 0 of the baseline and of classic TP, on the training's step-0 batch.
    Returns {"baseline": ..., "tp_no_sp": ...}, each {loss, grad_norm, memory}."""
    group, device = dist.group.WORLD, current_device()
    ids, labels = (t.to(device) for t in data.batch(data.make_corpus(seed=spec.seed), 0,
                                                    spec.batch, spec.seq, spec.seed))
    out = {}
    for mode in ("baseline", "tp_no_sp"):
        model = build_model("baseline", spec.config, None, device, spec.torch_dtype, spec.seed)
        if mode == "tp_no_sp":
            model = classic_tp_model(model, group)
        meter = SavedActivationBytes(model)
        loss, norm, sizes = train_step(mode, model, make_optimizer(model, spec.lr), ids, labels,
                                       group if mode == "tp_no_sp" else None, meter)
        out[mode] = {"loss": loss, "grad_norm": norm,
                     "memory": {**sizes, "saved_activation_bytes": meter.bytes,
                                "saved_activation_storages": meter.count}}
    return out


def summarize(per_rank, dtype):
    """results.json's `memory_tp_no_sp`; raises if the loss is not the baseline's."""
    base = per_rank[0]["baseline"]
    ranks = [r["tp_no_sp"] for r in per_rank]
    loss_diff = max(abs(r["loss"] - base["loss"]) / abs(base["loss"]) for r in ranks)
    norm_diff = max(abs(r["grad_norm"] - base["grad_norm"]) / base["grad_norm"] for r in ranks)
    if not loss_diff <= SAME_LOSS_TOL[dtype]:
        raise RuntimeError(f"classic TP (no SP): step-0 loss {ranks[0]['loss']!r} differs from "
                           f"the baseline's {base['loss']!r} by {loss_diff:.2e} relative, more "
                           f"than the {SAME_LOSS_TOL[dtype]:g} {dtype} round-off allows: not the "
                           f"same model")
    return {"tp": len(per_rank), "step": 0, "memory_per_rank": [r["memory"] for r in ranks],
            "loss": ranks[0]["loss"], "grad_norm": ranks[0]["grad_norm"],
            "baseline_loss": base["loss"], "baseline_grad_norm": base["grad_norm"],
            "baseline_memory": base["memory"],
            "loss_rel_diff_vs_baseline": loss_diff, "grad_norm_rel_diff_vs_baseline": norm_diff}
