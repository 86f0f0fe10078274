"""Grouped-query and multi-query attention: the baseline's grouping, and TP with k/v heads
split or replicated, against the baseline."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tensor_parallel_toy.support.sharding import load_full_state_dict
from tensor_parallel_toy import ModelConfig, Transformer

from .helpers import (assert_matches_baseline, assert_one_line, compare_on_world, fixed_batch,
                      max_rel_error)

# 12 query heads of head_dim 4: divisible by TP 2, 3 and 4.
BASE = dict(vocab_size=96, hidden_size=48, num_layers=2, num_heads=12, ffn_hidden_size=96,
            max_seq_len=32)


def _as_multi_head(gqa_state, config):
    """The same network as multi-head attention: each query head gets its own copy of the k/v
    head it reads (head i reads k/v head i // g), in the rows `[heads, (q, k, v), hd]`."""
    nh, nkv, hd, h = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    g = nh // nkv
    state = {}
    for name, value in gqa_state.items():
        if name.endswith("attn.qkv.weight"):
            grouped = value.view(nkv, g + 2, hd, h)  # per k/v head: g query heads, k, v
            q = grouped[:, :g].reshape(nh, hd, h)
            k, v = (grouped[:, i].repeat_interleave(g, dim=0) for i in (g, g + 1))  # [nh, hd, h]
            value = torch.stack([q, k, v], dim=1).reshape(3 * nh * hd, h)
        state[name] = value
    return state


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_gqa_baseline_equals_multi_head_with_shared_kv_heads(num_kv_heads):
    gqa_config = ModelConfig(**BASE, num_kv_heads=num_kv_heads)
    gqa = Transformer(gqa_config, seed=5)
    names = {n for n, _ in gqa.named_parameters()}
    assert "layers.0.attn.qkv.weight" in names, sorted(names)
    mha = Transformer(ModelConfig(**BASE), seed=0)
    load_full_state_dict(mha, _as_multi_head(gqa.state_dict(), gqa_config))
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    err = max_rel_error(gqa(ids), mha(ids))
    assert err <= 1e-5, f"GQA vs multi-head with repeated k/v heads: {err:.3g} > 1e-5"


# (num_kv_heads, tp): k/v heads split (kv >= tp) or shared by tp / kv ranks (kv < tp), MQA included.
CASES = [(4, 2, False), (3, 3, True), (2, 4, False), (2, 4, True), (1, 3, False)]


@pytest.mark.parametrize("num_kv_heads,tp,overlap", CASES, ids=[
    f"kv{kv}-tp{tp}-{'overlap' if o else 'basic'}" for kv, tp, o in CASES])
def test_gqa_model_matches_baseline_with_kv_heads_split_or_shared(pools, num_kv_heads, tp,
                                                                      overlap):
    config = ModelConfig(**BASE, num_kv_heads=num_kv_heads)
    per_rank = pools(tp).run(compare_on_world, config, overlap=overlap)
    assert_matches_baseline(per_rank, config, f"kv={num_kv_heads} tp={tp} overlap={overlap}")


_JOINS = {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack}


class _ParameterJoins(TorchFunctionMode):
    """Records every call that joins tensors (cat, stack, ...) with a Parameter among them: a
    weight assembled anew on every call, an allocation and a copy per step."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _JOINS:
            joined = args[0] if args else (kwargs or {}).get("tensors", ())
            shapes = [list(t.shape) for t in joined if isinstance(t, nn.Parameter)]
            if shapes:
                self.calls.append(f"{func.__name__}{shapes}")
        return func(*args, **(kwargs or {}))


def _on_rank_parameter_joins():
    """{case: the joins of parameters in one forward + backward of a TP model}, for k/v heads
    split (4 over 2 ranks) and shared (1 over 2), each with the q/k/v bias."""
    calls = {}
    for nkv in (4, 1):
        for overlap in (False, True):
            config = ModelConfig(**{**BASE, "num_layers": 1}, num_kv_heads=nkv, qkv_bias=True)
            model = Transformer(config, tp_group=dist.group.WORLD, overlap=overlap)
            ids, labels = fixed_batch()
            with _ParameterJoins() as joins:
                model(ids, labels).backward()
            calls[f"kv={nkv} overlap={overlap}"] = joins.calls
    return calls


def test_tp_attention_joins_no_parameters_per_call(pools):
    """One qkv weight per rank, whatever the head layout: nothing concatenates q and k/v
    weights (or biases) on every forward."""
    for rank, calls in enumerate(pools(2).run(_on_rank_parameter_joins)):
        joined = {case: c for case, c in calls.items() if c}
        assert len(calls) == 4 and not joined, f"rank {rank}: parameters joined per call: {joined}"


def _on_rank_bad_kv_heads(num_kv_heads):
    try:
        Transformer(ModelConfig(**BASE, num_kv_heads=num_kv_heads), tp_group=dist.group.WORLD)
        message = None
    except ValueError as e:
        message = str(e)
    dist.barrier()  # every rank got here: nothing was left waiting in a collective
    return message


@pytest.mark.parametrize("num_kv_heads,tp", [(6, 4), (2, 3), (3, 2)])
def test_kv_heads_that_do_not_fit_the_tp_size_raise_one_clear_error(pools, num_kv_heads, tp):
    messages = pools(tp).run(_on_rank_bad_kv_heads, num_kv_heads)
    for msg in messages:
        assert_one_line(msg, [f"num_kv_heads={num_kv_heads}", f"size {tp}"],
                        f"num_kv_heads={num_kv_heads} at tp={tp}")


def test_num_heads_not_divisible_by_kv_heads_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"num_heads=12 is not divisible by num_kv_heads=5"):
        ModelConfig(**BASE, num_kv_heads=5)
