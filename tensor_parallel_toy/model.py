"""A pre-norm decoder-only transformer that runs with or without tensor + sequence parallelism.

`Transformer(config)` is the plain single-device baseline (nn.Linear everywhere, no
collectives). `Transformer(config, tp_group=g)` is the same network split Megatron-style:

    [s/p, b, h] --RMSNorm--> --qkv (column: all-gather seq)--> [s, b, 3h/p]
                --attention over this rank's h/p heads-->          [s, b, h/p]
                --proj (row: reduce-scatter seq)--> [s/p, b, h] --+ residual
                --RMSNorm--> --fc1 (column)--> [s, b, f/p] --GELU--> --fc2 (row)--> [s/p, b, h]

Between the blocks every rank holds its s/p sequence rows of the residual stream (sequence
parallel region); inside attention and the MLP it holds the full sequence but only its slice of
heads / ffn features (tensor parallel region). Parameter names are the same in both modes, so a
baseline state dict maps one to one onto the shards.
"""
import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import (all_gather_dim, gather_from_tensor_parallel_region, group_rank, group_size,
                   register_sequence_parallel_grad_hooks)
from .config import ModelConfig, check_seq_len
from .parallel_linear import column_linear, mark_tensor_parallel, row_linear


def mark_sequence_parallel(param):
    """A replicated parameter applied to sequence-parallel activations: each rank's gradient
    covers only its s/p tokens and must be summed over the TP group (see comm.py)."""
    param.sequence_parallel = True
    return param


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = mark_sequence_parallel(nn.Parameter(torch.ones(dim)))
        self.weight.init_std = None  # keep the ones

    def forward(self, x):
        rms = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * rms).type_as(x) * self.weight


def rotary_tables(seq_len, head_dim, base):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # [s, hd/2]
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x, cos, sin):
    """x [s, b, heads, hd]; rotate each (first half, second half) pair by its position's angle."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # [s, 1, 1, hd/2]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal multi-head attention; under TP each rank owns num_heads/p whole heads.

    The fused qkv weight is laid out head by head, `[heads, (q, k, v), head_dim]` along its rows,
    so a contiguous row shard of it holds complete q, k and v of a contiguous group of heads.
    """

    def __init__(self, config, tp_group=None, overlap=False):
        super().__init__()
        h = config.hidden_size
        self.head_dim = config.head_dim
        self.qkv = column_linear(h, 3 * h, tp_group, overlap)
        self.proj = row_linear(h, h, tp_group, overlap)
        self.proj.weight.init_std = 0.02 / math.sqrt(2 * config.num_layers)

    def forward(self, x, cos, sin):
        qkv = self.qkv(x)  # [s, b, 3h/p]
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, -1, 3, self.head_dim).unbind(dim=3)  # [s, b, nh/p, hd] each
        q, k = apply_rotary(q, cos[:s], sin[:s]), apply_rotary(k, cos[:s], sin[:s])
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, nh/p, s, hd]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, nh/p, s, hd]
        o = o.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, h/p]
        return self.proj(o)  # [s/p, b, h]


class MLP(nn.Module):
    def __init__(self, config, tp_group=None, overlap=False):
        super().__init__()
        self.fc1 = column_linear(config.hidden_size, config.ffn_hidden_size, tp_group, overlap)
        self.fc2 = row_linear(config.ffn_hidden_size, config.hidden_size, tp_group, overlap)
        self.fc2.weight.init_std = 0.02 / math.sqrt(2 * config.num_layers)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # [s/p,b,h] -> [s,b,f/p] -> [s/p,b,h]


class TransformerBlock(nn.Module):
    def __init__(self, config, tp_group=None, overlap=False):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = Attention(config, tp_group, overlap)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config, tp_group, overlap)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token embedding -> num_layers blocks -> final RMSNorm -> LM head.

    `model(input_ids)`: input_ids `[b, s]`, the same full batch on every rank -> full logits
    `[b, s, vocab]` on every rank. `model.loss(input_ids, labels)`: the mean cross-entropy over
    all b*s tokens, the same scalar on every rank.
    """

    def __init__(self, config: ModelConfig, tp_group=None, overlap=False, *, seed=0):
        super().__init__()
        self.tp_size = group_size(tp_group)
        config.check_tp_size(self.tp_size)  # before any collective can run
        self.config, self.tp_group, self.overlap = config, tp_group, overlap
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        mark_sequence_parallel(self.embed.weight)  # looked up for this rank's s/p tokens only
        self.layers = nn.ModuleList(
            TransformerBlock(config, tp_group, overlap) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.head = column_linear(config.hidden_size, config.vocab_size, tp_group, overlap)
        cos, sin = rotary_tables(config.max_seq_len, config.head_dim, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(seed)
        register_sequence_parallel_grad_hooks(self, tp_group)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, input_ids):
        b, s = input_ids.shape
        check_seq_len(s, self.tp_size, self.config.max_seq_len)
        ids = input_ids.t()  # [s, b]
        if self.tp_size > 1:
            ids = ids.chunk(self.tp_size, dim=0)[group_rank(self.tp_group)]  # [s/p, b]
        x = self.embed(ids)  # [s/p, b, h]
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        logits = self.head(self.norm(x))  # [s, b, V/p]
        logits = gather_from_tensor_parallel_region(logits, self.tp_group)  # [s, b, V]
        return logits.transpose(0, 1)  # [b, s, V]

    def loss(self, input_ids, labels):
        logits = self(input_ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    # -- weights ---------------------------------------------------------------------------------
    def _shard(self, full, param):
        dim = getattr(param, "tensor_parallel_dim", None)
        if dim is None or self.tp_size == 1:
            return full
        return full.chunk(self.tp_size, dim=dim)[group_rank(self.tp_group)]

    def _unshard(self, local, param):
        dim = getattr(param, "tensor_parallel_dim", None)
        if dim is None or self.tp_size == 1:
            return local
        return all_gather_dim(local, dim, self.tp_group)

    def _full_shape(self, param):
        shape = list(param.shape)
        dim = getattr(param, "tensor_parallel_dim", None)
        if dim is not None:
            shape[dim] *= self.tp_size
        return shape

    @torch.no_grad()
    def reset_parameters(self, seed=0):
        """Draw every *full* weight from its own generator (seeded by seed and name) and keep
        this rank's shard: any TP size starts from exactly the baseline's weights."""
        for name, param in self.named_parameters():
            std = getattr(param, "init_std", 0.02)
            if std is None:
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(self._full_shape(param), generator=gen) * std
            param.copy_(self._shard(full, param))

    @torch.no_grad()
    def load_full_state_dict(self, state_dict):
        """Load a baseline `Transformer(config).state_dict()`, keeping this rank's shards."""
        for name, param in self.named_parameters():
            full = state_dict[name]
            if list(full.shape) != self._full_shape(param):
                raise ValueError(f"{name}: checkpoint shape {list(full.shape)} does not match "
                                 f"the model's full shape {self._full_shape(param)}")
            param.copy_(self._shard(full.to(param.device, param.dtype), param))

    @torch.no_grad()
    def full_state_dict(self):
        """Full (unsharded) parameters under the baseline's keys, on every rank."""
        return {n: self._unshard(p.detach(), p) for n, p in self.named_parameters()}

    @torch.no_grad()
    def full_grads(self):
        """Full (unsharded) gradients under the baseline's keys, on every rank."""
        return {n: None if p.grad is None else self._unshard(p.grad, p)
                for n, p in self.named_parameters()}
