"""`parallelize_module` with a plan in PyTorch's words, on models of the user's own.

- Every style against PyTorch's own `parallelize_module` with the same plan, on one module that
  uses each of them (batch-first, odd batch): the output and every gradient.
- The nanoGPT-style example at TP 2, 3 and 4, overlap on and off, in fp32 (and with dropout,
  whose masks are one device's) and bf16: loss and every gradient against one device
  (`compare_with_one_device`); the example itself run from another directory (its training
  steps against one device, PyTorch's plan beside ours), as a reader runs it.
- A fused c_attn split as plain rows is reported by the comparison, naming c_attn first.
- What is refused, in one line on every rank, before any collective.
"""
import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from tensor_parallel_toy.apply import (ColwiseParallel, NoParallel, PrepareModuleInput,
                                       PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                       compare_with_one_device,
                                       matching_modules, parallelize_module, torch_plan)
from tensor_parallel_toy.comm import reduce_from_tensor_parallel_region
from tensor_parallel_toy.examples import nanogpt_tp as ex
from tensor_parallel_toy.parallel_linear import shard
from tensor_parallel_toy.support.sharding import layouts

from .helpers import (FP32_TOL, assert_errors, assert_one_line, max_rel_error,
                      value_error_messages)
from .processes import installed_env


class Mix(nn.Module):
    """A block that reads the whole sequence (PrepareModuleInput gathers it), a classic
    column / row pair inside."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(10, 6), nn.Linear(6, 10)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class EveryStyle(nn.Module):
    """Embedding -> (norm -> column -> GELU -> row) residual -> (norm -> gathered block)
    residual -> norm -> head gathered -> classic column / row pair on the gathered logits ->
    a replicated layer -> split again, a norm, gathered. Batch-first, [b, t, ...]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 10)
        self.norm = nn.LayerNorm(10)
        self.up = nn.Linear(10, 18)
        self.down = nn.Linear(18, 10)
        self.norm3 = nn.LayerNorm(10)
        self.mix = Mix()
        self.norm2 = nn.LayerNorm(10)
        self.head = nn.Linear(10, 12, bias=False)
        self.fc1 = nn.Linear(12, 6)
        self.fc2 = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)  # after the sum: the same data on every rank
        self.tail = nn.Sequential(nn.LayerNorm(3))
        self.gather = nn.Identity()
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.5)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        x = x + self.mix(self.norm3(x))
        logits = self.head(self.norm2(x))
        return self.gather(self.tail(self.out(self.fc2(F.relu(self.fc1(logits))))))


EVERY_STYLE_PLAN = {
    "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm*": SequenceParallel(),
    "up": ColwiseParallel(input_layouts=Shard(1)),
    "down": RowwiseParallel(output_layouts=Shard(1)),
    "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    "fc1": ColwiseParallel(),
    "fc2": RowwiseParallel(),
    "out": NoParallel(),
    "mix": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mix.a": ColwiseParallel(),
    "mix.b": RowwiseParallel(output_layouts=Shard(1)),
    "tail": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
    "tail.0": SequenceParallel(),
    "gather": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
}


def _on_rank_every_style_vs_torch(overlap):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize
    import copy

    group = dist.group.WORLD
    torch.manual_seed(0)
    base = EveryStyle()
    ours = parallelize_module(copy.deepcopy(base), group, EVERY_STYLE_PLAN, overlap=overlap)
    theirs = torch_parallelize(copy.deepcopy(base), DeviceMesh.from_group(group, "cpu"),
                               torch_plan(EVERY_STYLE_PLAN))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 12, (3, 6), generator=gen)
    weight = torch.randn(3, 6, 3, generator=gen)
    out_ours, out_theirs = ours(ids), theirs(ids)
    if isinstance(out_theirs, DTensor):
        out_theirs = out_theirs.full_tensor()
    (out_ours * weight).sum().backward()
    (out_theirs * weight).sum().backward()
    errors = {"output": max_rel_error(out_ours, out_theirs)}
    mine = dict(ours.named_parameters())
    split = layouts(ours)
    for name, param in theirs.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        errors[name] = max_rel_error(mine[name].grad, shard(grad, split[name], group))
    errors["#params"] = len(mine)
    return errors


@pytest.mark.parametrize("tp, overlap", [(2, False), (3, True)])
def test_every_style_equals_pytorchs_parallelize_module(pools, tp, overlap):
    per_rank = pools(tp).run(_on_rank_every_style_vs_torch, overlap)
    for r in per_rank:
        assert r.pop("#params") == len(list(EveryStyle().parameters())) == len(r) - 1, r
    assert_errors(per_rank, FP32_TOL, f"every style vs PyTorch, tp={tp} overlap={overlap}")


def test_plan_keys_match_as_pytorch_reads_them():
    gpt = ex.GPT(ex.CONFIG)
    names = [n for n, _ in matching_modules(gpt, "transformer.h.*.ln_*")]
    assert names == ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.h.1.ln_1",
                     "transformer.h.1.ln_2"], names
    assert [n for n, _ in matching_modules(gpt, "*.wte")] == ["transformer.wte"]
    assert matching_modules(gpt, "transformer.h.*") and not matching_modules(gpt, "h.*.attn")


# ----------------------------------------------------------------------------------------------
# The nanoGPT-style model against one device
# ----------------------------------------------------------------------------------------------
def _on_rank_nanogpt(overlap, dtype=torch.float32, dropout=0.0, plain_c_attn=False):
    config = dataclasses.replace(ex.CONFIG, dropout=dropout)
    plan = ex.make_plan(config)
    if plain_c_attn:  # the naive way: q|k|v rows split as one block
        plan["transformer.h.*.attn.c_attn"] = ColwiseParallel(input_layouts=Shard(1))
    report = compare_with_one_device(
        lambda: ex.GPT(config),
        lambda m, g: parallelize_module(m, g, plan, overlap=overlap,
                                        check_replicated_grads="first"),
        ex.batch_of(0, config), ex.gpt_loss, dtype=dtype)
    return {"ok": report.ok, "text": str(report), "failures": report.failures,
            "n": len(report.errors)}


@pytest.mark.parametrize("tp, overlap, dtype, dropout", [
    (2, True, torch.float32, 0.0), (2, False, torch.float32, 0.3), (4, True, torch.float32, 0.0),
    (3, False, torch.float32, 0.0), (2, True, torch.bfloat16, 0.0)],
    ids=["tp2-overlap", "tp2-dropout", "tp4-overlap", "tp3", "tp2-bf16"])
def test_nanogpt_loss_and_every_gradient_equal_one_devices(pools, tp, overlap, dtype, dropout):
    n_params = len(list(ex.GPT(ex.CONFIG).parameters()))
    for r in pools(tp).run(_on_rank_nanogpt, overlap, dtype, dropout):
        assert r["ok"] and r["n"] == n_params + 1, r["text"]


def test_fused_c_attn_split_as_plain_rows_is_reported_naming_c_attn(pools):
    for r in pools(2).run(_on_rank_nanogpt, False, plain_c_attn=True):
        assert not r["ok"], r["text"]
        assert "c_attn" in r["failures"][0], r["text"]
        assert "split as plain rows: transformer.h.1.attn.c_attn" in r["text"], r["text"]


# Run from another directory (the background's folder), as a reader runs it.
BACKGROUND = {"nanogpt": lambda folder: dict(
    argv=[sys.executable, "-m", "tensor_parallel_toy.examples.nanogpt_tp"], cwd=folder,
    env=installed_env())}


@pytest.mark.background("nanogpt")
def test_nanogpt_example_runs_from_another_directory_and_says_it_equals_one_device(background):
    code, out, err = background.result("nanogpt")
    assert code == 0, out + err
    assert "loss and every gradient equal one device's" in out, out


# ----------------------------------------------------------------------------------------------
# Refusals: one line, on every rank, before any collective
# ----------------------------------------------------------------------------------------------
def _on_rank_refusals():
    group = dist.group.WORLD
    plan = ex.make_plan(ex.CONFIG)

    def split(changes, seq=ex.SEQ, dropout=0.0):
        def run():
            torch.manual_seed(0)
            changed = {k: v for k, v in {**plan, **changes}.items() if v is not None}
            config = dataclasses.replace(ex.CONFIG, dropout=dropout)
            model = parallelize_module(ex.GPT(config), group, changed)
            model(*ex.batch_of(0, seq=seq))
        return run

    cases = {
        "missing": split({"transformer.ln_f": None}),
        "misspelt": split({"transformer.h.*.atn.c_proj": RowwiseParallel()}),
        "odd sequence": split({}, seq=7),
        "dropout": split({"transformer.h.*.mlp.dropout": None}, dropout=0.1),
        "not a style": split({"transformer.ln_f": "SequenceParallel"}),
        "tie split once": split({"lm_head": NoParallel()}),
        "whole over split": split({"transformer.h.*.mlp": SequenceParallel()}),
        "other weights": lambda: parallelize_module(
            ex.GPT(ex.CONFIG) if dist.get_rank() == 0 else
            (torch.manual_seed(1), ex.GPT(ex.CONFIG))[1], group, plan),
        "fused shape": split({"transformer.h.*.attn.c_attn": ColwiseParallel(
            input_layouts=Shard(1), output_shape=(3, 12, 5), split_dim=1)}),
        # Padded only when gathered: split logits would carry padding the loss cannot know of.
        "odd head left split": lambda: parallelize_module(nn.Linear(10, 7), group,
                                                          ColwiseParallel()),
    }
    return value_error_messages(cases)


def test_mistakes_are_refused_in_one_line_naming_the_culprit(pools):
    words = {
        "missing": ["'transformer.ln_f.weight'", "neither split nor kept whole"],
        "misspelt": ["'transformer.h.*.atn.c_proj'", "matches no module"],
        "odd sequence": ["'transformer.wte'", "dim 1 of input shape [2, 7]", "7 positions",
                         "TP size 2", "pad it to 8", "refused, not padded"],
        "dropout": ["'transformer.h.0.mlp.dropout'", "SequenceParallel"],
        "not a style": ["plan['transformer.ln_f']", "builtins.str", "not a style",
                        "valid are ColwiseParallel"],
        "tie split once": ["lm_head.weight", "tied"],
        "whole over split": ["'transformer.h.0.mlp'", "'transformer.h.0.mlp.c_fc'"],
        "other weights": ["built different models or plans", "sum:transformer.wte.weight"],
        "fused shape": ["output_shape=(3, 12, 5)", "out_features=144"],
        "odd head left split": ["out_features=7", "TP size 2", "Replicate()", "pad the layer to 8",
                                "vocab_size=7"],
    }
    for rank, messages in enumerate(pools(2).run(_on_rank_refusals)):
        for key, message in messages.items():
            assert_one_line(message, words[key], f"rank {rank}, {key}")


# ----------------------------------------------------------------------------------------------
# The classic opt-in (classic_plan) on the same model: a fused c_attn needs its shape
# ----------------------------------------------------------------------------------------------
def _on_rank_classic_opt_in(declare_shape):
    from tensor_parallel_toy.apply.classic_tp import classic_plan

    config = ex.CONFIG

    def opt_in(model, group):
        for block in model.transformer.h:
            block.attn.tp_column, block.attn.tp_row = "c_attn", "c_proj"
            block.mlp.tp_column, block.mlp.tp_row = "c_fc", "c_proj"
        plan = classic_plan(model)
        if declare_shape:
            hd = config.n_embd // config.n_head
            for key in plan:
                if key.endswith("attn.c_attn"):
                    plan[key] = ColwiseParallel(output_shape=(3, config.n_head, hd), split_dim=1)
        return parallelize_module(model, group, plan)

    report = compare_with_one_device(lambda: ex.GPT(config), opt_in, ex.batch_of(0),
                                     ex.gpt_loss)
    return {"ok": report.ok, "text": str(report), "failures": report.failures}


def test_classic_opt_in_is_exact_with_a_declared_shape_and_reported_without(pools):
    for declare_shape in (True, False):
        for r in pools(2).run(_on_rank_classic_opt_in, declare_shape):
            assert r["ok"] == declare_shape, r["text"]
            if not declare_shape:
                assert "c_attn" in r["failures"][0], r["text"]


# ----------------------------------------------------------------------------------------------
# The logits left split, the loss from them (vocab_parallel_cross_entropy)
# ----------------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(12, 10), nn.LayerNorm(10)
        self.head = nn.Linear(10, 12, bias=False)
        self.tp_group = None  # the loss's group: None on one device

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))  # [b, t, V], or [b, t, V/p] split


def _on_rank_split_logits():
    from tensor_parallel_toy.vocab_parallel import vocab_parallel_cross_entropy

    plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(), "head": ColwiseParallel(input_layouts=Shard(1))}

    def parallelize(model, group):
        model.tp_group = group
        return parallelize_module(model, group, plan)

    gen = torch.Generator().manual_seed(3)
    batch = torch.randint(0, 12, (3, 8), generator=gen), torch.randint(0, 12, (3, 8), generator=gen)
    report = compare_with_one_device(
        TinyLM, parallelize, batch,
        lambda m, b: vocab_parallel_cross_entropy(m(b[0]), b[1], m.tp_group))
    return {"ok": report.ok, "text": str(report)}


def test_logits_left_split_give_the_loss_through_vocab_parallel_cross_entropy(pools):
    for r in pools(2).run(_on_rank_split_logits):
        assert r["ok"], r["text"]


# ----------------------------------------------------------------------------------------------
# A fused gate|up (SwiGLU): the other fused projection, split per half
# ----------------------------------------------------------------------------------------------
class FusedSwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(12, 10), nn.LayerNorm(10)
        self.gate_up = nn.Linear(10, 2 * 6)  # gate rows, then up rows
        self.down = nn.Linear(6, 10)

    def forward(self, ids):
        x = self.emb(ids)
        gate, up = self.gate_up(self.norm(x)).unflatten(-1, (2, -1)).unbind(-2)
        return x + self.down(F.silu(gate) * up)


def _on_rank_gate_up(declare_shape):
    shape = dict(output_shape=(2, 6), split_dim=1) if declare_shape else {}
    plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "gate_up": ColwiseParallel(input_layouts=Shard(1), **shape),
            "down": RowwiseParallel(output_layouts=Shard(1))}
    gen = torch.Generator().manual_seed(4)
    ids, weight = torch.randint(0, 12, (3, 8), generator=gen), torch.randn(3, 8, 10, generator=gen)

    def loss(model, ids):
        out = model(ids)  # [3, 8/p, 10] under SP: this rank's rows of the weight
        w = weight if out.shape[1] == 8 else weight.chunk(dist.get_world_size(), 1)[
            dist.get_rank()]
        return (out * w).sum() if out.shape[1] == 8 else \
            reduce_from_tensor_parallel_region((out * w).sum(), dist.group.WORLD)

    report = compare_with_one_device(
        FusedSwiGLU, lambda m, g: parallelize_module(m, g, plan, overlap=True), ids, loss)
    return {"ok": report.ok, "text": str(report), "failures": report.failures}


def test_fused_gate_up_is_exact_split_per_half_and_reported_as_plain_rows(pools):
    for declare_shape in (True, False):
        for r in pools(2).run(_on_rank_gate_up, declare_shape):
            assert r["ok"] == declare_shape, r["text"]
            if not declare_shape:
                assert "split as plain rows: gate_up" in r["text"], r["text"]


def test_classic_opt_in_refuses_an_output_shape_that_does_not_fit_the_layer():
    from tensor_parallel_toy.apply.classic_tp import classic_plan

    gpt = ex.GPT(ex.CONFIG)
    attn = gpt.transformer.h[0].attn
    attn.tp_column, attn.tp_row = "c_attn", "c_proj"
    plan = classic_plan(gpt)
    plan["transformer.h.0.attn.c_attn"] = ColwiseParallel(output_shape=(3, 12, 5), split_dim=1)
    with pytest.raises(ValueError) as info:
        parallelize_module(gpt, None, plan)
    assert_one_line(str(info.value), ["'transformer.h.0.attn.c_attn'", "(3, 12, 5)",
                                      "out_features=144"], "bad shape")
