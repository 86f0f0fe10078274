"""The `dtensor` mode (PyTorch's own TP applied to our baseline model) trains like the baseline.

Checked on every rank, against the baseline on full tensors, along three SGD steps: the loss,
every parameter's gradient (full, and this rank's local part), the gradient norm, and the
parameters after each step. Also checked: the sequence-parallel trap is real, i.e. before
`reduce_partial_grads` a norm weight's local gradient is only a partial sum, so the check of
local gradients fails without the fix (and so this test can fail).
"""
import dataclasses

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard

from tensor_parallel_toy import Transformer
from tensor_parallel_toy.interop import dtensor_tp

from .helpers import (CONFIG, MODEL_FP32_TOL, assert_errors, fixed_batch, max_rel_error,
                      train_beside_baseline)

TRAP_MIN_ERROR = 1e-2  # a partial sum over half the tokens is off by O(1), not by round-off


def _expected_local(full, grad, rank, p):
    """This rank's part of a full baseline tensor, in the layout of the DTensor `grad`."""
    for placement in grad.placements:
        if isinstance(placement, Shard):
            return full.chunk(p, dim=placement.dim)[rank]
    return full


def _on_rank_dtensor_vs_baseline(steps, kv_heads=None):
    """The DTensor plan trained beside the baseline (helpers.train_beside_baseline), plus, at
    every step: the trap (each Partial gradient's local part before reduce_partial_grads),
    whether the grad norm refused to read it, and every local gradient after the fix."""
    group = dist.group.WORLD
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    config = dataclasses.replace(CONFIG, num_kv_heads=kv_heads or CONFIG.num_heads)
    model = dtensor_tp.parallelize_transformer(Transformer(config, seed=0), group)
    trap, raised, steps_done = {}, [], []

    def step(ids, labels, base):
        base_grads = {n: q.grad for n, q in base.named_parameters()}
        loss = dtensor_tp.transformer_loss_and_backward(model, ids, labels)
        for name, param in model.named_parameters():
            grad = param.grad
            if any(isinstance(pl, Partial) for pl in grad.placements):  # the trap, unreduced
                want = _expected_local(base_grads[name], grad, rank, p)
                trap[name] = min(trap.get(name, 1.0), max_rel_error(grad.to_local(), want))
        try:
            dtensor_tp.placement_grad_norm(model, group)
        except ValueError:
            raised.append(len(steps_done))
        steps_done.append(1)
        dtensor_tp.reduce_partial_grads(model)
        local = {"local grad:" + name: max_rel_error(
                     param.grad.to_local(), _expected_local(base_grads[name], param.grad, rank, p))
                 for name, param in model.named_parameters()}
        return {"loss": loss, "grads": {n: q.grad.full_tensor() for n, q in model.named_parameters()},
                "grad_norm": dtensor_tp.placement_grad_norm(model, group), "errors": local}

    errors = train_beside_baseline(
        config, step, lambda: {n: q.full_tensor() for n, q in model.named_parameters()},
        model.parameters(), steps=steps, batch_of=lambda step: fixed_batch(seed=step))
    errors.pop("#grads")
    is_dtensor = all(isinstance(q, DTensor) for q in model.parameters())
    return {"errors": errors, "trap": trap, "raised": raised, "all_dtensor": is_dtensor}


@pytest.mark.parametrize("tp, kv_heads", [(2, None), (4, None), (2, 4)],
                         ids=["tp2", "tp4", "tp2-gqa4"])
def test_dtensor_mode_loss_every_gradient_and_params_match_baseline(pools, tp, kv_heads):
    steps = 3
    per_rank = pools(tp).run(_on_rank_dtensor_vs_baseline, steps, kv_heads)
    assert_errors([r["errors"] for r in per_rank], MODEL_FP32_TOL,
                   f"dtensor tp={tp} kv_heads={kv_heads}")
    config = dataclasses.replace(CONFIG, num_kv_heads=kv_heads or CONFIG.num_heads)
    names = list(dict(Transformer(config).named_parameters()))
    for r in per_rank:
        assert r["all_dtensor"], "parallelize left a parameter that is not a DTensor"
        missing = [n for n in names if f"local grad:{n}" not in r["errors"]]
        assert not missing, f"gradients not checked: {missing}"


@pytest.mark.parametrize("tp", [2, 4])
def test_dtensor_sequence_parallel_grads_are_partial_until_reduced(pools, tp):
    """The trap: every norm weight's local gradient is a partial sum (an O(1) error against
    the baseline) until reduce_partial_grads, and grad_norm refuses to read it before then."""
    per_rank = pools(tp).run(_on_rank_dtensor_vs_baseline, 1)
    norms = [n for n in dict(Transformer(CONFIG).named_parameters()) if n.endswith("norm.weight")]
    for rank, r in enumerate(per_rank):
        assert sorted(r["trap"]) == sorted(norms), (
            f"rank {rank}: Partial gradients {sorted(r['trap'])}, expected the norms {norms}")
        small = {n: e for n, e in r["trap"].items() if not e >= TRAP_MIN_ERROR}
        assert not small, f"rank {rank}: unreduced local grads already match the baseline: {small}"
        assert r["raised"] == [0], f"rank {rank}: grad_norm on Partial grads did not raise"


@pytest.mark.parametrize("change, words", [
    (dict(tie_embeddings=True), ["tie_embeddings=True", "untie"]),
    (dict(num_kv_heads=2), ["num_kv_heads=2 < TP size 4", "at least 4"]),
    (dict(mlp="swiglu"), ["mlp='swiglu'", "parallelize_hf_model"]),
    (dict(num_kv_heads=6), ["num_kv_heads=6", "tensor-parallel size 4"]),
    (dict(vocab_size=97), ["vocab_size=97", "does not pad"]),  # the package's model does
])
def test_dtensor_plan_refuses_what_it_cannot_express(change, words):
    with pytest.raises(ValueError) as info:
        dtensor_tp.check_transformer_plan(dataclasses.replace(CONFIG, **change), 4)
    assert all(w in str(info.value) for w in words), str(info.value)
