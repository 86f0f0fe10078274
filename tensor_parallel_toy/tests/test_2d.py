"""2D parallelism on 4 ranks, a 2 x 2 (data parallel x tensor parallel) grid, the data-parallel
part done by PyTorch's engines: FSDP2 (`fully_shard`) over our TP model and over the DTensor
plan, DDP over our TP model. Checked against the baseline on the whole batch, along two SGD
steps: the loss, every full gradient, the gradient norm, and every parameter afterwards; the
model's weights are loaded into the *wrapped* model, and its gradients and state read back
from it, so the parameter marks must have survived the wrapping."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from tensor_parallel_toy.support.sharding import full_grads, full_state_dict, load_full_state_dict
from tensor_parallel_toy import ModelConfig, Transformer
from tensor_parallel_toy.interop import dtensor_tp
from tensor_parallel_toy.comm import all_reduce_
from tensor_parallel_toy.interop.data_parallel import (apply_ddp, apply_fsdp, data_parallel_loss,
                                               init_mesh_2d, split_batch)
from tensor_parallel_toy.support.sharding import grad_norm

from .helpers import (MODEL_FP32_TOL, assert_bf16, assert_errors, max_rel_error, mesh_2x2,
                      random_batch, train_beside_baseline, value_error_messages)

CONFIG = ModelConfig(vocab_size=96, hidden_size=48, num_layers=2, num_heads=12,
                     ffn_hidden_size=96, max_seq_len=32, num_kv_heads=2)
# One k/v head for two TP ranks: each holds a copy of its rows, which FSDP then splits too.
MQA = dataclasses.replace(CONFIG, num_kv_heads=1, qkv_bias=True)
GLOBAL_BATCH = 4
STEPS = 2


def _wrap(engine, kind, overlap, bf16, config):
    """The 2-D model: (wrapped, the Transformer inside it)."""
    mesh = mesh_2x2()
    if kind == "ours":
        # Another seed than the baseline's: loading the baseline's weights into the wrapped
        # model (below) must be what makes them equal.
        model = Transformer(config, tp_group=mesh["tp"].get_group(), overlap=overlap, seed=1)
    else:
        model = dtensor_tp.parallelize_transformer(Transformer(config, seed=0), mesh["tp"])
    if engine == "ddp":
        wrapped = apply_ddp(model, mesh)
        return wrapped, wrapped.module
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else None
    return apply_fsdp(model, mesh, mp_policy=policy), model


def _on_rank_engine(engine, kind, overlap, seq, bf16=False, config=CONFIG):
    """The 2-D model trained beside the baseline (helpers.train_beside_baseline), each DP rank
    on its half of every global batch; loss, gradients and norm read from the wrapped model."""
    wrapped, model = _wrap(engine, kind, overlap, bf16, config)
    if kind == "ours":
        load_full_state_dict(model, Transformer(config, seed=0).state_dict())
    dp_group, tp_group = mesh_2x2()["dp"].get_group(), mesh_2x2()["tp"].get_group()

    def step(ids, labels, base):
        ids, labels = split_batch(ids, dp_group), split_batch(labels, dp_group)
        if kind == "ours":
            loss = data_parallel_loss(wrapped, ids, labels, dp_group)
            loss.backward()
            grads, norm = full_grads(model), grad_norm(wrapped, tp_group)
        else:  # equal token counts on both halves: the mean of the two means is the batch mean
            loss = dtensor_tp.transformer_loss_and_backward(wrapped, ids, labels)
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
            norm = norm.full_tensor()
        whole = all_reduce_(loss.detach().float().clone(), dp_group) / dist.get_world_size(dp_group)
        return {"loss": whole, "grads": grads, "grad_norm": float(norm)}

    def params():
        if kind == "ours":
            return full_state_dict(model)
        return {n: p.full_tensor() for n, p in model.named_parameters()}

    def batch_of(step):
        ignore = 0.4 if kind == "ours" else 0.0
        ids, labels = random_batch(config, GLOBAL_BATCH, seq, seed=step, ignore_frac=ignore)
        if kind == "ours":  # uneven token counts on the two DP halves
            labels[:GLOBAL_BATCH // 2, : seq // 2] = -100
        return ids, labels

    return train_beside_baseline(config, step, params, wrapped.parameters(), steps=STEPS,
                                 batch_of=batch_of, bf16=bf16)


CASES = [("fsdp", "ours", False, 8), ("fsdp", "ours", True, 7), ("fsdp", "dtensor", False, 8),
         ("ddp", "ours", False, 8), ("ddp", "ours", True, 7)]


@pytest.mark.parametrize("engine,kind,overlap,seq", CASES,
                         ids=[f"{e}-{k}-{'overlap' if o else 'basic'}-seq{s}"
                              for e, k, o, s in CASES])
def test_2x2_engine_over_tensor_parallel_matches_baseline_on_the_whole_batch(
        pools, engine, kind, overlap, seq):
    per_rank = pools(4).run(_on_rank_engine, engine, kind, overlap, seq)
    counts = {errors.pop("#grads") for errors in per_rank}
    n_params = len(dict(Transformer(CONFIG).named_parameters()))
    assert counts == {n_params}, f"compared {counts} gradients, the model has {n_params}"
    assert_errors(per_rank, MODEL_FP32_TOL, f"2x2 {engine} x {kind} TP, overlap={overlap}")


def test_2x2_fsdp_over_tensor_parallel_with_a_shared_k_v_head_matches_baseline(pools):
    """MQA: the TP pair shares one k/v head (its rows summed over the pair in backward, counted
    once by the norm), and FSDP splits each TP rank's rows, shared ones included, over dp."""
    per_rank = pools(4).run(_on_rank_engine, "fsdp", "ours", True, 7, config=MQA)
    counts = {errors.pop("#grads") for errors in per_rank}
    n_params = len(dict(Transformer(MQA).named_parameters()))
    assert counts == {n_params}, f"compared {counts} gradients, the model has {n_params}"
    assert_errors(per_rank, MODEL_FP32_TOL, "2x2 fsdp x ours, one k/v head for two TP ranks")


def test_2x2_fsdp_bf16_mixed_precision_is_as_close_as_single_device_bf16(pools):
    """bf16 parameters for compute, fp32 gradient reduction and fp32 master weights: no worse
    than the whole model in bf16 on one device (both against the fp32 baseline)."""
    per_rank = pools(4).run(_on_rank_engine, "fsdp", "ours", True, 7, bf16=True)
    for errors in per_rank:
        errors.pop("#grads")
    assert_bf16(per_rank, "2x2 fsdp x ours, bf16 params / fp32 reduce")


def _on_rank_wrapped_by_hand(wrap):
    """FSDP2 applied by hand, as PyTorch's docs teach (each block, then the root), or DDP, over
    the TP model, no package helper told anything: its full weights and gradients read back
    from the wrapped model. A vocabulary of 97: the embedding and the head padded to 98 rows
    over the TP pair, 49 per TP rank, which fully_shard splits unevenly over the DP pair."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    mesh = mesh_2x2()
    config = dataclasses.replace(CONFIG, vocab_size=97)
    model = Transformer(config, tp_group=mesh["tp"].get_group(), seed=0)
    before = dict(model.named_parameters())
    if wrap == "fully_shard":
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        model = DistributedDataParallel(model, device_mesh=mesh["dp"])
    baseline = Transformer(config, seed=0)
    ids, labels = random_batch(config, 2, 16, seed=3)  # the same batch on every rank
    model(ids, labels).backward()
    baseline(ids, labels).backward()
    weights, grads = full_state_dict(model), full_grads(model)
    want = dict(baseline.named_parameters())
    errors = {f"weight {n}": max_rel_error(t, want[n].detach()) for n, t in weights.items()}
    errors.update({f"grad {n}": max_rel_error(t, want[n].grad) for n, t in grads.items()})
    errors["names missing"] = float(len(set(want) - set(weights)))
    if wrap == "fully_shard":  # what makes marks on the Parameters useless
        errors["Parameters not replaced"] = float(sum(
            p is before[n] for n, p in model.named_parameters()))
    return errors


@pytest.mark.parametrize("wrap", ["fully_shard", "ddp"])
def test_full_weights_and_grads_after_wrapping_by_hand_equal_one_device(pools, wrap):
    """fully_shard replaces every Parameter; the layouts live on the modules, so the full
    weights and gradients read back from a model wrapped by hand (2 x 2: dp x tp) are one
    device's, never a TP shard returned as if whole; DDP's wrapper is looked through."""
    assert_errors(pools(4).run(_on_rank_wrapped_by_hand, wrap), MODEL_FP32_TOL,
                  f"full_state_dict / full_grads after {wrap} by hand")


def _on_rank_bad_mesh():
    return value_error_messages({
        "mesh": lambda: init_mesh_2d(dp_size=3, tp_size=2),
        "batch": lambda: split_batch(torch.zeros(3, 4), dist.group.WORLD)})


def test_bad_mesh_or_batch_size_raises_one_clear_error(pools):
    messages = pools(4).run(_on_rank_bad_mesh)[0]
    assert messages["mesh"] and "dp_size=3 x tp_size=2 = 6" in messages["mesh"] \
        and "has 4" in messages["mesh"], messages
    assert messages["batch"] and "batch size 3" in messages["batch"] \
        and "data-parallel size 4" in messages["batch"], messages


def _on_rank_plan_under_fully_shard(wrap):
    """nanoGPT split by its plan over the TP group, then wrapped over the DP group by hand: its
    LayerNorms' gradients are summed over TP in the graph (apply/sequence_parallel.py)."""
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from tensor_parallel_toy import parallelize_module
    from tensor_parallel_toy.examples import nanogpt_tp as ng

    mesh = mesh_2x2()
    config = dataclasses.replace(ng.CONFIG, dropout=0.0)
    torch.manual_seed(0)
    one = ng.GPT(config)
    model = parallelize_module(copy.deepcopy(one), mesh["tp"].get_group(), ng.make_plan(config),
                               check_replicated_grads=None)
    if wrap == "fully_shard":
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        model = DistributedDataParallel(model, device_mesh=mesh["dp"])
    batch = ng.batch_of(0, config)  # the same on every rank: DP's mean is one device's
    message = value_error_messages({"step": lambda: ng.gpt_loss(model, batch).backward()})
    if message["step"] is not None:
        return message
    ng.gpt_loss(one, batch).backward()
    reference = dict(one.named_parameters())
    worst = 0.0
    inner = model.module if wrap == "ddp" else model
    for name, param in inner.named_parameters():
        if ".ln_" in name:
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            full = reference[name].grad
            worst = max(worst, ((grad - full).norm() / full.norm()).item())
    return {"step": None, "worst LayerNorm grad error": worst}


@pytest.mark.parametrize("wrap", ["fully_shard", "ddp"])
def test_a_plans_model_under_fully_shard_or_ddp_by_hand_keeps_its_layernorm_sums(pools, wrap):
    """fully_shard replaces every Parameter; a sum kept as a hook on the Parameter would be
    lost (each rank stepping with its partial LayerNorm gradient, about 0.95 and 0.05 of it
    here). The plan's SequenceParallel sums are `f` in the graph: every LayerNorm gradient is
    one device's, under fully_shard and under DDP."""
    for r in pools(4).run(_on_rank_plan_under_fully_shard, wrap):
        assert r["step"] is None and r["worst LayerNorm grad error"] < 1e-5, r
