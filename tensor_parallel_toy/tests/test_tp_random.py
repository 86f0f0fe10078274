"""The tensor-parallel region's own random stream (apply/random.py), at TP 2 under a plan.

A tiny attention block, batch-first, SP: LayerNorm on this rank's rows, q, k, v as three
ColwiseParallel layers (each enters the TP region), dropout on the probabilities
`[b, heads/p, s, s]` drawn in a function (no module a plan could name) or inside
`F.scaled_dot_product_attention(dropout_p=...)`, `o` RowwiseParallel (leaves the region), and an
nn.Dropout on the output's rows (SequenceParallel: one device's mask).

- Masks drawn in the TP region differ across ranks; SDPA on heads equal across ranks gives
  different outputs (its dropout draws the rank's own stream).
- The SP region's mask on every rank is the slice of the mask one device draws from the same
  state, and the default stream after forward and backward is where one device drawing only
  that mask leaves it, on every rank.
- A forward that raises inside the region leaves the normal stream in place; eval mode draws
  nothing and equals one device.
- Dropout 0 (in training mode): the loss and every gradient equal one device's.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from tensor_parallel_toy.apply import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                       SequenceParallel, parallelize_module)
from tensor_parallel_toy.parallel_linear import shard
from tensor_parallel_toy.support.sharding import layouts

from .helpers import FP32_TOL, assert_errors, max_rel_error, world

B, S, H, HEADS = 2, 4, 8, 4


class Attention(nn.Module):
    """[b, s, h] -> [b, s, h]; the masks it drew kept in `drawn`."""

    def __init__(self, p_attn, p_out, sdpa=False):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.q, self.v, self.o = (nn.Linear(H, H) for _ in range(3))
        self.k = nn.Linear(H, H, bias=False)  # softmax ignores k's bias: its gradient is 0
        self.drop = nn.Dropout(p_out)
        self.p_attn, self.sdpa, self.fail, self.drawn = p_attn, sdpa, False, {}

    def forward(self, x):
        x = self.norm(x)
        q, k, v = (lin(x).unflatten(-1, (-1, H // HEADS)).transpose(1, 2)  # [b, nh, s, hd]
                   for lin in (self.q, self.k, self.v))
        if self.fail:
            raise RuntimeError("failed inside the tensor-parallel region")
        p = self.p_attn if self.training else 0.0
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # [b, nh, s, hd]
            self.drawn["sdpa"] = y.detach()
        else:
            mask = F.dropout(torch.ones(q.shape[:3] + (k.shape[2],)), p)  # [b, nh, s, s]
            self.drawn["attn"] = mask == 0
            y = ((q @ k.transpose(-2, -1)).softmax(-1) * mask) @ v
        y = self.o(y.transpose(1, 2).flatten(2))  # [b, s, h]
        out = self.drop(y)
        self.drawn["out"] = (out == 0) & (y != 0)
        return out


PLAN = {"": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
        "norm": SequenceParallel(), "q": ColwiseParallel(input_layouts=Shard(1)),
        "k": ColwiseParallel(input_layouts=Shard(1)), "v": ColwiseParallel(input_layouts=Shard(1)),
        "o": RowwiseParallel(output_layouts=Shard(1)), "drop": SequenceParallel()}


def _split(one, group):
    return parallelize_module(copy.deepcopy(one), group, PLAN, tp_seed=1234)


def _one_and_split(p_attn, p_out):
    """The one-device attention from seed 0, its split copy, a full input and this rank's rows
    of it (the sequence is dim 1)."""
    group, p, rank = world()
    torch.manual_seed(0)
    one = Attention(p_attn, p_out)
    x = torch.randn(B, S, H)
    return one, _split(one, group), x, x.chunk(p, dim=1)[rank]


def _gather(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group)
    return out


def _on_rank_masks(p_attn, p_out, sdpa):
    group, p, rank = world()
    torch.manual_seed(0)
    one = Attention(p_attn, p_out, sdpa)
    if sdpa:  # heads of rank 1 = heads of rank 0: equal outputs on both unless the masks differ
        with torch.no_grad():
            for t in (one.q.weight, one.q.bias, one.k.weight, one.v.weight, one.v.bias):
                t.view(HEADS, -1)[HEADS // 2:] = t.view(HEADS, -1)[:HEADS // 2]
    model = _split(one, group)
    x = torch.randn(B, S, H)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    model(x.chunk(p, dim=1)[rank]).pow(2).sum().backward()
    after = torch.get_rng_state()
    torch.set_rng_state(before)  # one device drawing the SP region's mask only, from there
    one_device_out = F.dropout(torch.ones(B, S, H), p_out) == 0
    key = "sdpa" if sdpa else "attn"
    return {"tp_region": [t.float() for t in _gather(model.drawn[key].float(), group)],
            "sp_is_one_devices_slice": torch.equal(model.drawn["out"],
                                                   one_device_out.chunk(p, dim=1)[rank]),
            "stream_as_one_devices": torch.equal(after, torch.get_rng_state()),
            "stream_same_on_ranks": all(torch.equal(s, after) for s in _gather(after, group))}


def test_tp_region_masks_differ_across_ranks_sp_masks_are_one_devices(pools):
    for r in pools(2).run(_on_rank_masks, 0.5, 0.5, False):
        a, b = r["tp_region"]
        assert a.shape == (B, HEADS // 2, S, S) and 0 < a.mean() < 1, a
        assert not torch.equal(a, b), "ranks 0 and 1 drew the same mask for different heads"
        assert r["sp_is_one_devices_slice"], "the SP region's mask is not one device's slice"
        assert r["stream_as_one_devices"] and r["stream_same_on_ranks"], (
            "the default stream after the step is not where one device drawing the SP mask "
            f"leaves it: {r}")


def test_sdpa_dropout_on_equal_heads_differs_across_ranks(pools):
    for r in pools(2).run(_on_rank_masks, 0.5, 0.5, True):
        a, b = r["tp_region"]
        assert not torch.equal(a, b), "SDPA's dropout drew the same mask on both ranks"
        assert r["sp_is_one_devices_slice"] and r["stream_as_one_devices"], r


def _on_rank_raise_and_eval():
    one, model, x, mine = _one_and_split(0.5, 0.5)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    model.fail = True
    try:
        model(mine)
        raised = False
    except RuntimeError:
        raised = True
    model.fail = False
    restored = torch.equal(torch.get_rng_state(), before) and not model.tp_random.inside
    one.eval()
    model.eval()
    errors = {"eval out": max_rel_error(model(mine), one(x))}
    return {"raised": raised, "restored": restored, "errors": errors,
            "eval drew nothing": torch.equal(torch.get_rng_state(), before)}


def test_a_forward_that_raises_inside_restores_the_stream_and_eval_draws_nothing(pools):
    results = pools(2).run(_on_rank_raise_and_eval)
    for r in results:
        assert r["raised"] and r["restored"] and r["eval drew nothing"], r
    assert_errors([r["errors"] for r in results], FP32_TOL, "eval mode against one device")


def _on_rank_dropout_zero():
    one, model, x, mine = _one_and_split(0.0, 0.0)
    loss = model(mine).pow(2).sum()
    ref = one(x).pow(2).sum()
    loss.backward()
    ref.backward()
    errors = {"loss": max_rel_error(loss, ref)}
    split = dict(model.named_parameters())
    split_layouts = layouts(model)
    for name, param in one.named_parameters():
        errors[name] = max_rel_error(split[name].grad,
                                     shard(param.grad, split_layouts[name], dist.group.WORLD))
    return errors


def test_dropout_zero_in_training_equals_one_device_loss_and_every_gradient(pools):
    per_rank = pools(2).run(_on_rank_dropout_zero)
    n = len(list(Attention(0.0, 0.0).parameters()))
    assert all(len(e) == n + 1 for e in per_rank), per_rank
    assert_errors(per_rank, FP32_TOL, "dropout 0 against one device")
