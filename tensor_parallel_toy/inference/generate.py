"""Generating text with the package's `Transformer`, split over a TP group or on one device, with
one code path: the model's own forward, given a KV cache (a client of the kernel: it passes the
cache through `Transformer.hidden_states` into each `Attention`).

Why inference is not the training forward run token by token:
- A decode step has one new token per sequence, so sequence parallelism has nothing to split:
  generation runs the model's layers with `sequence_parallel` off (classic Megatron TP, the
  same layers switched): every rank holds the whole `[t, b, h]` activation between the
  layers, a column layer is `f` and this rank's GEMM, a row layer this rank's GEMM followed by
  `g`, an all-reduce of `[t, b, h]` (two per block, plus one for the embedding), and the
  logits are gathered along the vocabulary. The prompt (prefill) runs the same way, t = its
  length: no sequence parallelism there either, so prefill and decode share every line.
- Each rank caches the keys and values of its own k/v heads only: `[b, nkv/p, T, hd]` per layer,
  1/p of one device's cache; with fewer k/v heads than ranks, the p/nkv ranks that share a k/v
  head each hold it, one head per rank (`KVCache`).
- Sampling must pick the same token on every rank, or the ranks go on with different sequences
  and either hang in a collective of another size or return text nobody asked for. Here every
  rank holds the same logits (the gather copies the same bytes to every rank) and draws from a
  generator seeded alike, so the tokens agree by construction; `check_tokens` compares them
  anyway, one all-gather of b int64 per step, and raises `RanksDisagreeError` on every rank
  when they differ (a rank given another seed, say).

A batch of prompts of different lengths is left-padded, with an `attention_mask` (1: token,
0: pad), as `transformers` does it: positions count the tokens only, and no query sees a pad.
"""
from contextlib import contextmanager

import torch

from ..comm import all_gather_dim, gather_from_tensor_parallel_region, group_size
from ..guards.agreement import RanksDisagreeError, agree_on_batch, by_value, check_ranks_agree
from ..guards.batch import check_token_ids


class KVCache:
    """This rank's keys and values, per attention layer `[b, kv heads here, length, hd]`: the
    k/v heads its query heads read (nkv/p of them, or one shared head when nkv < p); and, for
    the tokens being fed, their positions and which keys each may see.

    `Attention.attend` calls `update(attention, k, v)` with the new tokens' keys and values
    `[b, kv heads here, t, hd]` and gets back every position's so far, and the mask."""

    def __init__(self, model, batch, length, dtype=None, device=None):
        weight = model.layers[0].attn.qkv.weight
        dtype = dtype or weight.dtype
        device = device or weight.device
        self.window = model.config.sliding_window
        self.slot = {}  # each Attention module's index in keys and values
        self.keys, self.values = [], []
        for block in model.layers:
            attn = block.attn
            heads = attn.qkv.weight.shape[0] // ((attn.q_per_kv + 2) * attn.head_dim)
            shape = (batch, heads, length, attn.head_dim)
            self.slot[attn] = len(self.keys)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
        self.length = 0  # positions filled
        self.positions = None  # [t, b]: the fed tokens' positions (rotary)
        self.visible = None  # [b, 1, t, T]: which key each fed token may see

    def feed(self, mask, t):
        """Before a forward of t new tokens: `mask` `[b, T]` covers every position so far,
        these t included."""
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [b, T]: a token's index among tokens
        query_pos = positions[:, -t:]
        self.visible = _visible(mask.bool(), positions, query_pos, self.window)
        self.positions = query_pos.t()  # [t, b]

    def update(self, attention, k, v):
        """Write the new keys and values `[b, heads here, t, hd]` at the cache's end; return
        every position's so far and the attention mask's keywords."""
        i = self.slot[attention]
        start = self.length
        end = start + k.shape[2]
        self.keys[i][:, :, start:end] = k
        self.values[i][:, :, start:end] = v
        return self.keys[i][:, :, :end], self.values[i][:, :, :end], {"attn_mask": self.visible}

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _visible(key_ok, key_pos, query_pos, window):
    """`[b, 1, t, T]`: query i may see key j (a token, not a pad; not later; inside the window).
    A pad query sees itself, so that no row is empty (its output is never used)."""
    seen = key_ok[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
    if window is not None:
        seen &= query_pos[:, :, None] - key_pos[:, None, :] < window
    t = query_pos.shape[1]
    own = torch.zeros_like(seen)
    own[:, :, -t:] = torch.eye(t, dtype=torch.bool, device=seen.device)
    return (seen | own).unsqueeze(1)


@contextmanager
def without_sequence_parallelism(model):
    """The model's layers switched to classic TP for the duration (see the module)."""
    switched = [m for m in model.modules() if getattr(m, "sequence_parallel", False)]
    for module in switched:
        module.sequence_parallel = False
    try:
        yield model
    finally:
        for module in switched:
            module.sequence_parallel = True


def _logits(model, ids, mask, cache):
    """The next-token logits `[b, V]` (fp32) after feeding `ids` `[b, t]` at the cache's end;
    `mask` `[b, T]` covers every position so far, these t included. The model's own forward,
    its layers without sequence parallelism (`without_sequence_parallelism`)."""
    cache.feed(mask, ids.shape[1])
    last = model.hidden_states(ids.t(), cache)[-1]  # [b, h], the last position's
    cache.length += ids.shape[1]
    local = model.head(last)  # [b, V/p]
    logits = gather_from_tensor_parallel_region(local, model.tp_group)  # [b, V'], padded
    return logits[:, :model.config.vocab_size].float()  # [b, V]: no padding can be chosen


def _next_token(logits, do_sample, temperature, top_k, generator):
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def _check_tokens(tokens, step, group):
    """Every rank must hold the same tokens: one all-gather of b int64, one host read."""
    every = all_gather_dim(tokens.unsqueeze(0), 0, group)  # [p, b]
    if not bool((every == every[0]).all()):
        raise RanksDisagreeError(
            f"the {group_size(group)} ranks of the tensor-parallel group chose different tokens "
            f"at step {step}: {by_value(every.tolist())}; they must sample from the same "
            f"logits with the same seed (generate(..., seed=) the same on every rank)")


def _check_request(model, ids, mask, max_new_tokens, do_sample, temperature, top_k):
    """One line naming the bad value (after the ranks agreed on the request: the same on
    every rank)."""
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.shape[0] == 0:
        raise ValueError(f"input_ids of shape {tuple(ids.shape)}: give [batch, prompt length] "
                         f"with at least one token")
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)}: must match input_ids "
                         f"{tuple(ids.shape)}")
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty (its attention_mask is all 0): give each "
                         f"prompt at least one token")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be a positive integer")
    total, most = ids.shape[1] + max_new_tokens, model.config.max_seq_len
    if total > most:
        raise ValueError(f"a prompt of {ids.shape[1]} positions plus max_new_tokens="
                         f"{max_new_tokens} is {total} positions, more than the model's "
                         f"max_seq_len={most}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0 when sampling")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k={top_k!r}: must be a positive integer or None")
    check_token_ids(ids.masked_fill(mask == 0, 0), model.config.vocab_size, "token id")


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, *, max_new_tokens=16, do_sample=False,
             temperature=1.0, top_k=None, seed=0, eos_token_id=None, pad_token_id=0,
             check_tokens=True):
    """Continue each prompt of `input_ids` `[b, s]` (left-padded where `attention_mask` `[b, s]`
    has 0s) by up to `max_new_tokens` tokens: greedy (`do_sample=False`, the largest logit) or
    sampled (`temperature`, `top_k`, from a generator seeded with `seed`). A sequence that
    produced `eos_token_id` continues with `pad_token_id`; generation stops when all have, or
    after `max_new_tokens`. Returns `[b, s + n]`, the prompts then the new tokens, like
    `transformers`' `generate`, the same on every rank.

    The ranks must make the same request: the options and the prompts are compared first
    (two all-gathers of a few int64), so that a bad request raises the same one line on every
    rank before the model's first collective, never on some ranks only while the others wait.
    The seed is not compared (a rank may draw its own way on purpose): each step's tokens are,
    when `check_tokens`."""
    ids = input_ids
    mask = torch.ones_like(ids) if attention_mask is None else \
        attention_mask.to(ids.device, ids.dtype)  # beside the ids (a GPU's, under NCCL)
    group = model.tp_group
    options = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                   top_k=top_k, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                   check_tokens=check_tokens)
    check_ranks_agree(options, group, "generate() requests")
    agree_on_batch({"input_ids": ids, "attention_mask": mask}, group, "check")
    _check_request(model, ids, mask, max_new_tokens, do_sample, temperature, top_k)
    generator = None
    if do_sample:
        generator = torch.Generator(device=ids.device).manual_seed(seed)
    cache = KVCache(model, ids.shape[0], ids.shape[1] + max_new_tokens)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    out, step_ids = [ids], ids
    with without_sequence_parallelism(model):
        for step in range(max_new_tokens):
            logits = _logits(model, step_ids, mask, cache)
            tokens = _next_token(logits, do_sample, temperature, top_k, generator)
            if check_tokens and group_size(group) > 1:
                _check_tokens(tokens, step, group)
            out.append(tokens.masked_fill(done, pad_token_id)[:, None])
            if eos_token_id is not None:
                done |= tokens == eos_token_id
                if bool(done.all()):
                    break
            # A finished sequence is fed the model's own choice, an id in range whatever the
            # pad id: its outputs are never used, and each sequence attends only to its own.
            step_ids = tokens[:, None]
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
    return torch.cat(out, dim=1)
