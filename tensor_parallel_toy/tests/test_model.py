"""The Transformer split over TP ranks against the same network on one device: logits, loss,
every gradient and the parameters along SGD steps, bf16, overlap against basic, and the sizes
it refuses.

Functions named `_on_rank_*` run inside the worker ranks (see conftest.py) and return error
measures, never verdicts: the assertions run here in the pytest process and print the numbers.
The tolerance policy is in helpers.py (and tests/README.md).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensor_parallel_toy.support.sharding import full_grads, full_state_dict, load_full_state_dict
from tensor_parallel_toy import ColumnParallelLinear, ModelConfig, RowParallelLinear, Transformer
from tensor_parallel_toy.launcher.initialize import current_device

from .helpers import (BACKENDS, BATCH, CONFIG, assert_bf16, assert_errors,
                      assert_matches_baseline, assert_one_line, compare_on_world, fixed_batch,
                      max_rel_error, world)


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------
def _on_rank_check_model(overlap, steps, sequence_parallel=True):
    """Baseline vs TP from the same seed along `steps` SGD steps (helpers.compare_with_baseline:
    logits, loss, every full gradient, the grad norm, the parameters), and a TP model loaded
    from the baseline's state dict, which must hold exactly its weights."""
    errors = compare_on_world(CONFIG, overlap=overlap, steps=steps,
                              sequence_parallel=sequence_parallel)
    dev = current_device()
    base = Transformer(CONFIG, seed=0).to(dev)
    loaded = Transformer(CONFIG, tp_group=world()[0], overlap=overlap, seed=99).to(dev)
    load_full_state_dict(loaded, base.state_dict())
    errors.update({"load:" + k: max_rel_error(v, base.state_dict()[k])
                   for k, v in full_state_dict(loaded).items()})
    return errors


def _on_rank_check_model_bf16():
    group, _, _ = world()
    dev = current_device()
    ref = Transformer(CONFIG, seed=0).to(dev)  # fp32 reference
    base = Transformer(CONFIG, seed=0).to(dev, torch.bfloat16)
    tp = Transformer(CONFIG, tp_group=group, overlap=True, seed=0).to(dev, torch.bfloat16)
    ids, labels = fixed_batch()
    results = {}
    for model in (ref, base, tp):
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        grads = full_grads(model) if model is tp else {
            n: p.grad for n, p in model.named_parameters()}
        results[model] = {"logits": logits, "loss": loss,
                          **{"grad:" + n: g for n, g in grads.items()}}
    return {k: (max_rel_error(results[tp][k], v), max_rel_error(results[base][k], v))
            for k, v in results[ref].items()}


def _on_rank_overlap_vs_basic():
    """The ring, and the ring in 3 pieces per chunk (the sequence padded to a multiple of
    3p), against whole collectives."""
    group, _, _ = world()
    out = {}
    for overlap in (False, True, 3):  # 3: overlap=True, ring_pieces=3
        model = Transformer(CONFIG, tp_group=group, overlap=bool(overlap),
                            ring_pieces=overlap if overlap > 1 else 1, seed=3)
        ids, labels = fixed_batch(seed=11, seq=10)  # padded to 12 rows, 3 per rank
        model.loss(ids, labels).backward()
        out[overlap] = {"loss": model.loss(ids, labels).detach(), **full_grads(model)}
    return {f"overlap={o} {k}": max_rel_error(out[o][k], v) for o in (True, 3)
            for k, v in out[False].items()}


def _on_rank_bad_inputs():
    """Each bad size must raise one clear ValueError on every rank before any collective."""
    group, p, _ = world()
    messages = {}

    def expect_error(key, fn):
        try:
            fn()
        except ValueError as e:
            messages[key] = str(e)
        else:
            messages[key] = None

    base = dict(vocab_size=96, hidden_size=48, num_layers=1, num_heads=12, ffn_hidden_size=96,
                max_seq_len=32)
    # head_dim must be even (rotary), so hidden_size is even: p=2 divides every valid one. Any
    # vocab_size splits, padded (test_vocab_parallel.py).
    bad = {"hidden_size": dict(hidden_size=2 * p + 2, num_heads=1), "num_heads": dict(num_heads=2),
           "ffn_hidden_size": dict(ffn_hidden_size=98)}
    for key, change in bad.items():
        expect_error(key, lambda: Transformer(ModelConfig(**{**base, **change}), tp_group=group))
    # A sequence length p does not divide: the model pads it, the sequence-parallel layers refuse.
    model = Transformer(ModelConfig(**base), tp_group=group)
    messages["model output"] = list(model(torch.zeros(BATCH, 2 * p + 1, dtype=torch.long)).shape)
    expect_error("sequence", lambda: RowParallelLinear(4 * p, 8, tp_group=group)(
        torch.zeros(2 * p + 1, BATCH, 4)))
    expect_error("column out_features",
                 lambda: ColumnParallelLinear(8, 4 * p + 1, tp_group=group))
    expect_error("row in_features", lambda: RowParallelLinear(4 * p + 1, 8, tp_group=group))
    dist.barrier()  # every rank got here: nothing was left waiting in a collective
    return messages


# ----------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("overlap", [False, True], ids=["basic", "overlap"])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_model_logits_loss_and_every_gradient_match_baseline(pools, tp, overlap, backend):
    assert_matches_baseline(pools(tp, backend).run(_on_rank_check_model, overlap, 3), CONFIG,
                            f"model tp={tp} overlap={overlap}")


@pytest.mark.parametrize("tp", [2, 3])
def test_classic_tp_model_without_sequence_parallelism_matches_baseline(pools, tp):
    """`sequence_parallel=False`: the same layers switched to `f` + GEMM and GEMM + `g`, the
    norms unsummed (each rank sees every row); an odd length needs no padding."""
    assert_matches_baseline(pools(tp).run(_on_rank_check_model, False, 2, False), CONFIG,
                            f"classic TP model tp={tp}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp", [2, 4])
def test_model_bf16_is_as_accurate_as_single_device_bf16(pools, tp, backend):
    assert_bf16(pools(tp, backend).run(_on_rank_check_model_bf16), f"model bf16 tp={tp}")


def test_overlap_equals_basic_to_fp32_roundoff(pools):
    assert_errors(pools(4).run(_on_rank_overlap_vs_basic), 5e-6, "overlap vs basic, tp=4")


@pytest.mark.parametrize("tp", [3, 4])
def test_bad_sizes_raise_one_clear_error_naming_the_values(pools, tp):
    messages = pools(tp).run(_on_rank_bad_inputs)[0]
    expected = {"hidden_size": [f"hidden_size={2 * tp + 2}", f"size {tp}"],
                "num_heads": ["num_heads=2", f"size {tp}"],
                "ffn_hidden_size": ["ffn_hidden_size=98", f"size {tp}"],
                "sequence": [f"sequence length={2 * tp + 1}", f"size {tp}"],
                "column out_features": [f"out_features={4 * tp + 1}"],
                "row in_features": [f"in_features={4 * tp + 1}"]}
    assert messages["model output"] == [BATCH, 2 * tp + 1, 96], messages["model output"]
    for key, parts in expected.items():
        assert_one_line(messages[key], parts, key)


