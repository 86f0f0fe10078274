"""A nanoGPT-style GPT-2 of your own, split by a plan in PyTorch's words: TP + SP + overlap.

    python -m tensor_parallel_toy.examples.nanogpt_tp                     # 2 local CPU ranks
    torchrun --nproc-per-node 2 -m tensor_parallel_toy.examples.nanogpt_tp

The model below is plain PyTorch (token and learned position embeddings, LayerNorm with bias,
a fused `c_attn`, GELU MLP, dropout, the head tied to the token embedding). `make_plan` splits
it. The model makes two concessions: it counts its heads with -1 in its views (each rank holds
n_head / p of them), and attention reads T from c_attn's output, not from its input (under SP
the input holds this rank's T/p positions; c_attn gathers the sequence; a block that must read
its whole input can have it gathered by `PrepareModuleInput`).

The run checks, on every rank: every gradient and the loss against the same model on one
device (`compare_with_one_device`), then a few training steps with dropout, each step's loss
against one device's, and the same plan carried out by PyTorch's own `parallelize_module`
(DTensor), its loss and every gradient against ours. Prints what it found; exits non-zero when
anything differs.
"""
import copy
import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from tensor_parallel_toy.apply import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                       compare_with_one_device, parallelize_module,
                                       rank_major_rows, torch_plan)
from tensor_parallel_toy.apply.compare import relative_error
from tensor_parallel_toy import current_device, launch
from tensor_parallel_toy.parallel_linear import shard
from tensor_parallel_toy.support.sharding import layouts


@dataclass
class GPTConfig:
    block_size: int = 24
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 12
    n_embd: int = 48
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q|k|v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3 * nh * hs); under SP x held T/p positions
        B, T = qkv.shape[:2]
        qkv = qkv.view(B, T, 3, -1, self.head_dim)  # (B, T, 3, nh, hs)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = self.attn_dropout(att) @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied
        for name, p in self.named_parameters():  # norms and biases drawn too, so none hides
            std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
            nn.init.normal_(p, 1.0 if ".ln_" in name and name.endswith("weight") else 0.0, std)

    def forward(self, idx, targets):  # idx, targets (B, T)
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def make_plan(config):
    """The whole split, batch-first: the sequence is dim 1 of every activation (dim 0 of the
    positions), split by the embeddings and gathered by the head's input."""
    return {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "transformer.wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "transformer.drop": SequenceParallel(),
        "transformer.h.*.ln_*": SequenceParallel(),
        "transformer.h.*.attn.c_attn": ColwiseParallel(
            input_layouts=Shard(1), output_shape=(3, config.n_head, config.n_embd //
                                                  config.n_head), split_dim=1),
        "transformer.h.*.attn.attn_dropout": SequenceParallel(sequence_dim=1),  # heads
        "transformer.h.*.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "transformer.h.*.attn.resid_dropout": SequenceParallel(),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(input_layouts=Shard(1)),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "transformer.h.*.mlp.dropout": SequenceParallel(),
        "transformer.ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


CONFIG = GPTConfig()
STEPS, BATCH, SEQ, LR, DROPOUT = 3, 2, 12, 0.1, 0.1
TOL = 1e-5  # fp32: TP only changes the order of additions


def batch_of(step, config=CONFIG, seq=SEQ):
    """ids and targets (B, T), the same on every rank, on its device (its GPU under NCCL)."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, config.vocab_size, (BATCH, seq + 1), generator=gen)
    ids = ids.to(current_device())
    return ids[:, :-1], ids[:, 1:]


def gpt_loss(model, batch):
    return model(*batch)


def train_beside_one_device(config, group, overlap, steps=STEPS):
    """Each step's loss under the plan and on one device (dropout on: the masks are one
    device's, so the two runs are the same computation)."""
    config = dataclasses.replace(config, dropout=DROPOUT)
    torch.manual_seed(0)
    one = GPT(config).to(current_device())
    tp = parallelize_module(copy.deepcopy(one), group, make_plan(config), overlap=overlap,
                            check_replicated_grads="first")
    losses = {"tp": [], "one device": []}
    for model, key in ((tp, "tp"), (one, "one device")):
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(steps):
            torch.manual_seed(100 + step)  # the same dropout masks in both runs
            loss = gpt_loss(model, batch_of(step, config))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[key].append(loss.item())
    return losses


def against_torch(config, group):
    """The same plan carried out by PyTorch's parallelize_module (DTensor) and by ours, from the
    same weights: the largest relative difference in the loss and in any full gradient."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    p = dist.get_world_size(group)
    plan = make_plan(config)
    torch.manual_seed(0)
    base = GPT(config).to(current_device())
    ours = parallelize_module(copy.deepcopy(base), group, plan)
    theirs = copy.deepcopy(base)
    # PyTorch splits a Linear's rows contiguously: lay c_attn's rows out rank by rank first.
    order = rank_major_rows(plan["transformer.h.*.attn.c_attn"], p)
    with torch.no_grad():
        for block in theirs.transformer.h:
            for t in (block.attn.c_attn.weight, block.attn.c_attn.bias):
                t.copy_(t[order])
    theirs = torch_parallelize(theirs, DeviceMesh.from_group(group, current_device().type),
                               torch_plan(plan))
    theirs.transformer.wte.weight = theirs.lm_head.weight  # parallelize_module untied them
    ids, targets = batch_of(0, config)
    loss_ours, loss_theirs = gpt_loss(ours, (ids, targets)), gpt_loss(theirs, (ids, targets))
    loss_ours.backward()
    loss_theirs.backward()
    worst = relative_error(loss_ours, loss_theirs.full_tensor()
                           if isinstance(loss_theirs, DTensor) else loss_theirs)
    mine = dict(ours.named_parameters())
    split = layouts(ours)
    for name, param in theirs.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            grad = grad[order.argsort()]
        worst = max(worst, relative_error(mine[name].grad, shard(grad, split[name], group)))
    return worst


def run_rank(config=CONFIG, overlap=True):
    group = dist.group.WORLD
    torch.manual_seed(0)
    report = compare_with_one_device(
        lambda: GPT(config).to(current_device()),
        lambda m, g: parallelize_module(m, g, make_plan(config), overlap=overlap),
        batch_of(0, config), gpt_loss, tp_group=group)
    return {"compare": str(report), "ok": report.ok,
            "train": train_beside_one_device(config, group, overlap),
            "torch": against_torch(config, group)}


def report(result):
    print(result["compare"])
    for step, (a, b) in enumerate(zip(result["train"]["tp"], result["train"]["one device"])):
        print(f"step {step}: TP loss {a:.6f}  one-device loss {b:.6f}")
    diff = max(abs(a - b) for a, b in zip(*result["train"].values()))
    print(f"PyTorch's parallelize_module with the same plan: loss and every gradient within "
          f"{result['torch']:.2g} of ours")
    if not (result["ok"] and diff <= TOL and result["torch"] <= TOL):
        raise SystemExit(f"differs from one device or from PyTorch (training {diff:.3g}, "
                         f"PyTorch {result['torch']:.3g}, tolerance {TOL:g})")
    print(f"loss and every gradient equal one device's; {len(result['train']['tp'])} training "
          f"steps with dropout {DROPOUT} too (max loss difference {diff:.2g})")


if __name__ == "__main__":
    results = launch(run_rank, 2)  # under torchrun: this rank's result only
    if os.environ.get("RANK", "0") == "0":
        report(results[0])
