"""A pre-norm decoder-only transformer that runs with or without tensor + sequence parallelism.

`Transformer(config)` is the plain single-device baseline (nn.Embedding, nn.Linear,
F.cross_entropy, no collectives). `Transformer(config, tp_group=group)` is the same network split
Megatron-style:

    ids [s, b] --embedding (vocab rows split; reduce-scatter seq)--> [s/p, b, h]
    [s/p, b, h] --RMSNorm--> --qkv (column: all-gather seq)--> [s, b, 3h/p]
                --attention over this rank's h/p heads-->          [s, b, h/p]
                --proj (row: reduce-scatter seq)--> [s/p, b, h] --+ residual
                --RMSNorm--> --fc1 (column)--> [s, b, m/p] --GELU--> --fc2 (row)--> [s/p, b, h]
                (or SwiGLU: --gate_up (column)--> [s, b, 2m/p] --silu(gate)*up--> --down (row)-->)
    ... blocks ... --RMSNorm--> --head (column)--> logits [s, b, V/p] --vocab-parallel loss-->

(A vocabulary p does not divide is padded to a multiple of p, in the embedding and the head:
V/p reads padded_vocab_size(V, p)/p; the padding is masked by the loss and dropped from the
logits returned, see vocab_parallel.py.)

Between the blocks every rank holds its s/p sequence rows of the residual stream (sequence
parallel region); inside attention and the MLP it holds the full sequence but only its slice of
heads / ffn features (tensor parallel region). Parameter names are the same in both modes, so a
baseline state dict maps one to one onto the shards.

`Transformer(config, tp_group=group, sequence_parallel=False)` is classic TP (Shoeybi et al.):
every rank holds the whole `[s, b, h]` between the layers, the column layers open with `f`, the
row layers and the embedding close with `g`, and the norms need no sum (generation runs so).

A sequence whose length the TP size does not divide is padded at its end (token 0, label
ignore_index): causal attention hides the padding from every real token, and the loss skips
it, so logits, loss and gradients are those of the unpadded sequence.
"""
import math
import warnings
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import copy_to_tensor_parallel_region, gather_from_tensor_parallel_region, group_size
from .config import ModelConfig, pad_sequence, padded_seq_len
from .parallel_linear import (RowSplit, column_parallel_or_plain, full_shape, layout_of,
                              row_parallel_or_plain, set_layout, shard)
from .rotary import rotary_tables, rotate
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy


UNCHECKED = ("this Transformer runs over a tensor-parallel group of {p} ranks unchecked: ranks "
             "given different batches would all return a mixed loss, ranks built differently "
             "would hang; call model = guard(model) (tensor_parallel_toy.guard) once, after "
             "building it")


@torch.no_grad()
def draw_full_weights_(model, tp_group, seed=0):
    """Draw every *full* weight of `model` from its own generator (seeded by seed and name),
    N(0, its layout's init_std) (None keeps the values built), and keep this rank's shard: any
    TP size starts from exactly the baseline's weights."""
    drawn = set()
    for name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            layout = layout_of(module, attr)
            if layout.init_std is None or id(param) in drawn:  # a tied weight: drawn once
                continue
            drawn.add(id(param))
            full_name = f"{name}.{attr}" if name else attr
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(full_name.encode()))
            full = torch.randn(full_shape(param, layout, group_size(tp_group)), generator=gen)
            param.copy_(shard(full * layout.init_std, layout, tp_group))


class RMSNorm(nn.Module):
    """x `[s/p, b, h]` (this rank's sequence rows) -> the same shape, each row scaled to unit
    RMS and multiplied by the weight `[h]`, which is replicated on every rank.

    Under SP each rank applies the weight to its own s/p rows only, so its gradient here is a
    partial sum over those rows; the weight's true gradient is the sum over the TP group. The
    weight therefore enters through `f` (forward identity, backward all-reduce): the sum is
    part of the autograd graph, so it survives engines that replace the Parameter objects
    (`fully_shard`), and each backward sums only its own contribution before autograd adds it
    to `.grad` (gradient accumulation stays exact).

    The same norm over each attention head (x `[s, b, heads/p, hd]`,
    weight `[hd]`, Qwen3's q/k norms) sits inside the tensor-parallel region: every rank sees all
    s tokens but only its own heads, so its gradient is again a partial sum, over heads instead
    of tokens, and the same `f` sums it.

    `tp_group`: the group whose ranks each see part of what this norm normalises (None: every
    rank sees all of it, as the residual stream's norms under classic TP: no sum).
    """

    def __init__(self, dim, eps=1e-5, tp_group=None):
        super().__init__()
        self.eps = eps
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.ones(dim))
        set_layout(self, "weight", init_std=None)  # drawn by no one: keep the ones

    def forward(self, x):
        return rms_norm(x, copy_to_tensor_parallel_region(self.weight, self.tp_group), self.eps)


def rms_norm(x, weight, eps):
    """x `[..., h]`, each row scaled to unit RMS (computed in fp32), times weight `[h]`."""
    rms = x.float().pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
    return (x.float() * rms).type_as(x) * weight


def qkv_rows(num_kv_heads, q_per_kv, head_dim, p):
    """The rows of the full qkv weight `[nkv, (q_per_kv q heads, k, v), hd]` each rank holds.

    nkv >= p: rank r holds k/v heads r*nkv/p:(r+1)*nkv/p whole, each with its query heads.
    nkv < p: the p/nkv ranks of one k/v head split its query heads, and each holds a copy of
    its k and v rows: a weight several ranks use, each for its own query heads, so the copies'
    gradients are partial and ColumnParallelLinear sums them over those ranks (`f`)."""
    full = torch.arange(num_kv_heads * (q_per_kv + 2) * head_dim).view(num_kv_heads, -1, head_dim)
    if num_kv_heads >= p:
        return RowSplit(torch.stack([c.flatten() for c in full.chunk(p)]))
    sharing = p // num_kv_heads  # ranks per k/v head
    return RowSplit(torch.stack([
        torch.cat([full[r // sharing, :q_per_kv].chunk(sharing)[r % sharing].flatten(),
                   full[r // sharing, q_per_kv:].flatten()]) for r in range(p)]))


class Attention(nn.Module):
    """Causal attention, multi-head or grouped-query; under TP each rank owns num_heads/p whole
    query heads and the k/v heads they read.

    One `qkv` weight whose rows are laid out k/v head by k/v head, `[nkv, (n q heads, k, v),
    hd]`, n = num_heads / num_kv_heads: query head i reads k/v head i // n, and the rows of a
    k/v head's whole group sit together. Multi-head attention is n = 1, `[heads, (q, k, v),
    hd]`; MQA is nkv = 1. On rank r:
    - num_kv_heads >= p: a row shard holds nkv/p whole groups, k/v heads r*nkv/p:(r+1)*nkv/p
      with exactly the query heads that read them.
    - num_kv_heads < p: the p/nkv ranks of one k/v head split its n query heads and each holds
      a copy of its k and v rows. Each copy's gradient covers only its rank's query heads, so
      those rows enter the GEMM through `f` over the ranks that share them (`qkv_rows`).
    Either way one all-gather of the input and one GEMM give this rank's q, k and v.

    head_dim need not be hidden_size / num_heads: the heads' features (nh * hd of them) are
    what the projections produce and `proj` consumes; p splits whole heads either way.
    With `qk_norm` each head's q and k are RMS-normalised (`q_norm`, `k_norm`, weights `[hd]`)
    before the rotation; with a `sliding_window` w, query i sees keys max(0, i - w + 1) .. i.

    With a `cache` (generation, inference/): the new tokens' keys and values join the cached
    ones, and the cache says which of those each query may see (`cache.update`), as past keys
    and values enter nanoGPT's and `transformers`' attention.

    `switches`: the layers' `sequence_parallel`, `overlap`, `ring_pieces` (parallel_linear.py).
    """

    def __init__(self, config, tp_group=None, **switches):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        nh, nkv = config.num_heads, config.num_kv_heads
        p = group_size(tp_group)
        q_per_kv = nh // nkv
        self.head_dim, self.window = hd, config.sliding_window
        # This rank's query heads per k/v head it holds: all of them, or its share of them.
        self.q_per_kv = q_per_kv // max(p // nkv, 1)
        # Bias rows are laid out like the weight's, so they are split (and shared) the same way.
        rows = None if tp_group is None else qkv_rows(nkv, q_per_kv, hd, p)
        self.qkv = column_parallel_or_plain(h, nkv * (q_per_kv + 2) * hd, tp_group,
                                            bias=config.qkv_bias, rows=rows, **switches)
        self.proj = row_parallel_or_plain(nh * hd, h, tp_group, **switches,
                                          init_std=0.02 / math.sqrt(2 * config.num_layers))
        # Replicated [hd] weights inside the TP region (each rank normalises only its own
        # heads): their gradients are partial sums over the heads, summed by the norm's `f`.
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.norm_eps, tp_group)
            self.k_norm = RMSNorm(hd, config.norm_eps, tp_group)

    def _mask(self, s, device):
        """The attention mask's keywords for s positions: causal, or causal within the window.
        Every rank holds the whole sequence here, so every rank builds the same mask."""
        if self.window is None or self.window >= s:
            return {"is_causal": True}
        offset = torch.arange(s, device=device)
        offset = offset[:, None] - offset[None, :]  # [s, s]: query position minus key position
        return {"attn_mask": (offset >= 0) & (offset < self.window)}  # True: may attend

    def forward(self, x, cos, sin, cache=None):
        return self.proj(self.attend(self.qkv(x), cos, sin, cache))  # [s/p, b, h]

    def attend(self, qkv, cos, sin, cache=None, *, norm=nn.Module.__call__):
        """Attention over this rank's heads, from its qkv rows `[s, b, rows]` -> `[s, b,
        nh*hd/p]`: what runs between the two layers (halves/ calls it between transfers).
        cos, sin: each position's rotary angles, `[s, 1 or b, 1, hd/2]` (`Transformer.rotary`).
        `norm(q_norm, q)` applies a q/k norm: by default the norm itself (its weight through
        its own `f`); halves/ passes one that reads weights it put through `f` itself."""
        n = self.q_per_kv  # query heads per k/v head on this rank
        qkv = qkv.unflatten(-1, (-1, n + 2, self.head_dim))  # [s, b, kv heads, n+2, hd]
        s, b = qkv.shape[:2]
        q = qkv[:, :, :, :n].reshape(s, b, -1, self.head_dim)  # [s, b, nh/p, hd]
        k, v = qkv[:, :, :, n], qkv[:, :, :, n + 1]  # [s, b, kv heads here, hd] each
        if self.q_norm is not None:  # each head's q and k normalised, then rotated
            q, k = norm(self.q_norm, q), norm(self.k_norm, k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hd]
        mask = self._mask(s, q.device)
        if cache is not None:  # every position so far: [b, kv heads here, T, hd]
            k, v, mask = cache.update(self, k, v)
        # enable_gqa: query head i reads k/v head i // n of this rank.
        o = F.scaled_dot_product_attention(q, k, v, **mask, enable_gqa=n > 1)  # [b, nh/p, s, hd]
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, nh*hd/p]


class MLP(nn.Module):
    """`fc2(gelu(fc1(x)))`: fc1 column-parallel, fc2 row-parallel."""

    def __init__(self, config, tp_group=None, **switches):
        super().__init__()
        h = config.hidden_size
        m = config.ffn_hidden_size
        self.fc1 = column_parallel_or_plain(h, m, tp_group, **switches)
        self.fc2 = row_parallel_or_plain(m, h, tp_group, **switches,
                                         init_std=0.02 / math.sqrt(2 * config.num_layers))

    def layers(self):
        """(the column layer, the row layer): halves/ runs them between its transfers."""
        return self.fc1, self.fc2

    def activate(self, y):
        """What runs between the two layers, on each feature alone."""
        return F.gelu(y)

    def forward(self, x):
        first, second = self.layers()
        return second(self.activate(first(x)))  # [s/p,b,h] -> [s,b,m/p] -> [s/p,b,h]


class SwiGLU(MLP):
    """`down(silu(gate(x)) * up(x))`, the MLP of Llama, Mistral and Qwen2.

    `gate` and `up` are both column-parallel, so they share one all-gather of x: they are one
    layer `gate_up` whose output has the shape `(2, m)` (gate is [0], up is [1]), split along
    m. Rank r's weight `[2m/p, h]` is its gate rows then its up rows: one GEMM gives both
    halves, and silu(gate) * up multiplies features that live on the same rank. `down` is
    row-parallel, like fc2.
    """

    def __init__(self, config, tp_group=None, **switches):
        nn.Module.__init__(self)
        h = config.hidden_size
        m = config.ffn_hidden_size
        self.gate_up = column_parallel_or_plain(h, (2, m), tp_group, split_dim=1, **switches)
        self.down = row_parallel_or_plain(m, h, tp_group, **switches,
                                          init_std=0.02 / math.sqrt(2 * config.num_layers))

    def layers(self):
        return self.gate_up, self.down

    def activate(self, y):
        gate, up = y.unflatten(-1, (2, -1)).unbind(-2)  # [s, b, m/p] each
        return F.silu(gate) * up


class TransformerBlock(nn.Module):
    """`x + attn(norm(x))`, then `x + mlp(norm(x))`. `tp_group`, `switches`: as for
    `Transformer` (the norms sum their gradients over the group only under SP)."""

    def __init__(self, config, tp_group=None, **switches):
        super().__init__()
        split_rows = tp_group if switches.get("sequence_parallel", True) else None
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps, split_rows)
        self.attn = Attention(config, tp_group, **switches)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps, split_rows)
        self.mlp = (SwiGLU if config.mlp == "swiglu" else MLP)(config, tp_group, **switches)

    def forward(self, x, cos, sin, cache=None):
        # The cache by keyword: a plan's PrepareModuleInput lays out the positional inputs.
        x = x + self.attn(self.attn_norm(x), cos, sin, cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token embedding -> num_layers blocks -> final RMSNorm -> LM head.

    `model(input_ids)`: input_ids `[b, s]`, the same full batch on every rank, any s up to
    max_seq_len -> full logits `[b, s, vocab]` on every rank (gathered: for inspection; a
    padded vocabulary's padding dropped).
    `model(input_ids, labels)` (or `model.loss(...)`, the same): the mean cross-entropy over
    the tokens whose label is not ignore_index, the same scalar on every rank, from
    vocab-sharded logits (never gathered).

    `sequence_parallel=False`: classic TP, every rank holding the whole `[s, b, h]` between the
    layers (`f` and `g` instead of the all-gathers and reduce-scatters); `overlap=True` (the
    rings, each chunk cut into `ring_pieces` transfers) needs sequence parallelism.

    No checks here: `guard(model)` (guards/) attaches them from outside, at the call site
    (the ranks compare what they built; each batch is checked before the forward's first
    collective; replicated gradients compared at the first backward). A TP model called
    without them says so once, with a warning: unguarded, ranks given different batches return
    a wrong number, and ranks that built different models hang.
    """

    said_unchecked = False

    def __init__(self, config: ModelConfig, tp_group=None, overlap=False, *, ring_pieces=1,
                 sequence_parallel=True, seed=0):
        super().__init__()
        self.tp_size = group_size(tp_group)
        config.check_tp_size(self.tp_size)  # before any layer is built
        # The layers' switches (parallel_linear.py); the baseline's nn.Linear takes none.
        switches = dict(sequence_parallel=sequence_parallel, overlap=overlap,
                        ring_pieces=ring_pieces)
        # Under SP, equal sequence chunks, one per rank (with overlap, ring_pieces equal pieces
        # each): shorter sequences are padded to a multiple of this.
        pieces = ring_pieces if overlap else 1
        self.seq_multiple = self.tp_size * pieces if sequence_parallel else 1
        self.config, self.tp_group, self.seed = config, tp_group, seed
        self.sequence_parallel, self.overlap = sequence_parallel, overlap
        if tp_group is None:
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                tp_group=tp_group, init_weights=False,
                                                sequence_parallel=sequence_parallel)
        self.layers = nn.ModuleList(
            TransformerBlock(config, tp_group, **switches) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps,
                            tp_group if sequence_parallel else None)
        self.head = column_parallel_or_plain(config.hidden_size, config.vocab_size, tp_group,
                                             pad=True, **switches)
        if config.tie_embeddings:
            # One Parameter, two uses: both gradients accumulate into it. Under TP the head
            # and the embedding split the same vocabulary rows, so the shards line up too.
            self.head.weight = self.embed.weight
        # Room for the padded length: a sequence of max_seq_len may be padded past it.
        cos, sin = rotary_tables(padded_seq_len(config.max_seq_len, self.seq_multiple),
                                 config.head_dim, config.rope_base, config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(seed)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, input_ids, labels=None, *, ignore_index=-100, label_smoothing=0.0,
                reduction="mean"):
        """`model(input_ids)`: the full logits `[b, s, V]`. `model(input_ids, labels)`: the
        cross-entropy of the logits at each position against labels `[b, s]` (already shifted
        by the caller), as F.cross_entropy computes it on the full logits, with the same
        keywords. "mean" is over the tokens not labelled ignore_index; "none" returns `[b, s]`.
        Under TP: from the vocab-sharded logits, which are never gathered.

        The loss is computed here, in `forward`, so that an engine which hooks `forward`
        (FSDP's all-gathers, DDP's gradient reduction) sees every training step."""
        if self.tp_size > 1 and "guards" not in self.__dict__ and not self.said_unchecked:
            self.said_unchecked = True  # once per model: unguarded, see the class docstring
            warnings.warn(UNCHECKED.format(p=self.tp_size), stacklevel=2)
        s = input_ids.shape[1]
        logits = self.sharded_logits(pad_sequence(input_ids.t(), self.seq_multiple, 0))
        if labels is None:
            logits = gather_from_tensor_parallel_region(logits, self.tp_group)  # [s', b, V']
            return logits[:s, :, :self.config.vocab_size].transpose(0, 1)
        labels = pad_sequence(labels.t(), self.seq_multiple, ignore_index)  # [s', b]
        loss = self.cross_entropy(logits, labels, reduction, ignore_index=ignore_index,
                                  label_smoothing=label_smoothing)
        return loss[:s].t() if reduction == "none" else loss  # [b, s] or a scalar

    def rotary(self, s, positions=None):
        """cos and sin `[s, 1, 1, hd/2]` of positions 0..s-1, or `[s, b, 1, hd/2]` of each
        token's own `positions` `[s, b]` (generation's left-padded prompts)."""
        if positions is None:
            return self.rope_cos[:s, None, None], self.rope_sin[:s, None, None]
        return self.rope_cos[positions][:, :, None], self.rope_sin[positions][:, :, None]

    def hidden_states(self, ids, cache=None):
        """ids `[s', b]` (s' padded to a multiple of p under SP) -> the final norm's output,
        this rank's `[s'/p, b, h]` (without SP: `[s', b, h]`). `cache`: see Attention."""
        cos, sin = self.rotary(ids.shape[0], None if cache is None else cache.positions)
        x = self.embed(ids)  # [s'/p, b, h]
        for layer in self.layers:
            x = layer(x, cos, sin, cache=cache)
        return self.norm(x)

    def sharded_logits(self, ids):
        """ids `[s', b]` -> this rank's logits `[s', b, V/p]`: the embedding, the blocks, the
        final norm and the head (halves/ runs them as two interleaved halves of the batch).
        A padded vocabulary's padding columns are here (logits 0, on the last ranks): the
        loss masks them (`cross_entropy`), and `model(ids)` drops them after the gather."""
        return self.head(self.hidden_states(ids))

    def cross_entropy(self, logits, labels, reduction, **options):
        """logits [s', b, V/p], labels [s', b] -> the loss (`options`: F.cross_entropy's
        ignore_index, label_smoothing); the baseline's is F.cross_entropy, the reference every
        TP result is compared with."""
        if self.tp_group is not None:
            return vocab_parallel_cross_entropy(logits, labels, self.tp_group,
                                                vocab_size=self.config.vocab_size,
                                                reduction=reduction, **options)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               reduction=reduction, **options)
        return loss.view(labels.shape) if reduction == "none" else loss

    def loss(self, input_ids, labels, **kwargs):
        """`model(input_ids, labels, **kwargs)`: the same call, so wrappers' hooks run too."""
        return self(input_ids, labels, **kwargs)

    def reset_parameters(self, seed=0):
        """Draw every full weight once, each rank keeping its shard (`draw_full_weights_`).
        Loading a baseline checkpoint, full state dicts and gradients: support/sharding.py."""
        draw_full_weights_(self, self.tp_group, seed)
