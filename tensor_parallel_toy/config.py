"""ModelConfig: the shape of the transformer, checked once, up front.

Every size the tensor-parallel layers split must divide by the TP size. We check that here,
before any process group or collective exists, so a bad size is one clear line instead of a
shape error inside a matmul on rank 3. The vocabulary is the exception: like Megatron, the
layers pad it to a multiple of the TP size (`padded_vocab_size`), so any size splits.
"""
from dataclasses import dataclass
from typing import Optional

import torch

MLP_KINDS = ("gelu", "swiglu")
ROPE_SCALINGS = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A fixed remapping of the rotary frequencies, for a model trained on longer contexts than
    its base frequencies were (`ModelConfig.rope_scaling`; None: the plain frequencies).

    "linear": every frequency divided by `factor` (positions interpolated: position t is
    rotated as t / factor was).
    "llama3" (Llama 3.1-3.3): by wavelength 2*pi/freq, relative to the pre-training context
    `original_max_seq_len`: wavelengths longer than original_max_seq_len / low_freq_factor are
    divided by `factor` (their frequencies, that is); shorter than original_max_seq_len /
    high_freq_factor are kept; in between, the frequency is blended linearly in
    original_max_seq_len / wavelength from freq / factor to freq.
    """
    kind: str
    factor: float
    low_freq_factor: float = 1.0  # "llama3" only
    high_freq_factor: float = 4.0  # "llama3" only
    original_max_seq_len: int = 8192  # "llama3" only

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RopeScaling.kind={self.kind!r}: valid kinds are {ROPE_SCALINGS}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"RopeScaling.{name}={value!r} must be a positive number")
        value = self.original_max_seq_len
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"RopeScaling.original_max_seq_len={value!r} must be a positive "
                             f"integer")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"RopeScaling high_freq_factor={self.high_freq_factor!r} must be "
                             f"above low_freq_factor={self.low_freq_factor!r}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int = 256
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    # Key/value heads: None means num_heads (multi-head attention); fewer is grouped-query
    # attention (GQA), where each group of num_heads/num_kv_heads query heads shares one k/v
    # head; 1 is multi-query attention (MQA).
    num_kv_heads: Optional[int] = None
    # One weight for the token embedding and the LM head (the head's `weight` *is* embed.weight).
    tie_embeddings: bool = False
    # "gelu": fc2(gelu(fc1(x))); "swiglu" (Llama, Mistral, Qwen2): down(silu(gate(x)) * up(x)).
    mlp: str = "gelu"
    # A bias on the q, k and v projections (Qwen2); the output projection never has one.
    qkv_bias: bool = False
    # The size of one attention head; None means hidden_size / num_heads. Any even value:
    # q has num_heads * head_dim features, k and v num_kv_heads * head_dim each, and the output
    # projection maps num_heads * head_dim back to hidden_size (Qwen3, Mistral-Nemo). Once
    # built, a config holds the number: dataclasses.replace keeps it unless given head_dim=None.
    head_dim: Optional[int] = None
    # An RMSNorm over each head's q and over each head's k (weights [head_dim], shared by all
    # heads), before the rotary embedding (Qwen3).
    qk_norm: bool = False
    # None: the plain rotary frequencies; else how they are remapped (Llama 3's "llama3").
    rope_scaling: Optional[RopeScaling] = None
    # Sliding-window attention in every layer: query i sees keys max(0, i - w + 1) .. i.
    # None: full causal attention (Mistral v0.1 uses 4096).
    sliding_window: Optional[int] = None

    def __post_init__(self):
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)  # frozen: set it once here
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                     "ffn_hidden_size", "max_seq_len", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if name == "head_dim" and value is None:  # the default: hidden_size / num_heads
                if self.hidden_size % self.num_heads:
                    raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                                     f"num_heads={self.num_heads}; change one, or set head_dim")
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
        for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} must be a bool")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"ModelConfig.mlp={self.mlp!r}: valid values are {MLP_KINDS}")
        for name in ("norm_eps", "rope_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive number")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} must be even for rotary embeddings (they rotate "
                f"pairs of features); choose an even head_dim")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling!r} must be None or "
                             f"a RopeScaling")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window < 1):
            raise ValueError(f"ModelConfig.sliding_window={window!r} must be None (full causal "
                             f"attention) or a positive integer")
        if self.num_heads % self.num_kv_heads:
            valid = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(f"num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.num_kv_heads}; valid num_kv_heads: {valid}")

    def check_tp_size(self, tp_size: int) -> None:
        """Raise one clear error if this model cannot be split over `tp_size` ranks. Any
        vocab_size can: the vocabulary is padded to a multiple of tp_size (`padded_vocab_size`)."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor-parallel size {tp_size!r} must be a positive integer")
        for name in ("hidden_size", "num_heads", "ffn_hidden_size"):
            value = getattr(self, name)
            valid = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
            check_divisible(name, value, tp_size, f"valid TP sizes for it: {valid}")
        # K/V heads are split when there are at least as many as ranks, and shared when there
        # are fewer (the p / nkv ranks of a k/v head split its query heads and each hold its k
        # and v rows): either way each rank's query heads find their k/v heads on that rank,
        # which needs one of the two to divide the other.
        kv = self.num_kv_heads
        if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
            valid = sorted({d for d in range(1, self.num_heads + 1)
                            if self.num_heads % d == 0 and (d % kv == 0 or kv % d == 0)})
            raise ValueError(
                f"num_kv_heads={kv} does not fit the tensor-parallel size {tp_size}: it must "
                f"be a multiple of it (k/v heads split) or divide it (k/v heads shared); "
                f"valid TP sizes for it: {valid}")


def check_overlap_option(overlap, ring_pieces=1) -> None:
    """overlap: False (whole collectives) or True (the ring); ring_pieces: the ring's transfers
    per chunk, m >= 1. Anything else is refused in one line."""
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap={overlap!r}: valid are False (whole collectives) and True "
                         f"(the ring); a number of ring pieces is ring_pieces=")
    if isinstance(ring_pieces, bool) or not isinstance(ring_pieces, int) or ring_pieces < 1:
        raise ValueError(f"ring_pieces={ring_pieces!r}: valid is a number of ring pieces m >= 1")


def check_divisible(name: str, value: int, tp_size: int, why: str = "") -> None:
    """The one check (and message) for every size the TP ranks split: `name=value` must be a
    multiple of the tensor-parallel size. `why`, if given, is appended to the message."""
    if value % tp_size:
        raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size "
                         f"{tp_size}" + (f"; {why}" if why else ""))


def padded_seq_len(seq_len: int, tp_size: int) -> int:
    """The smallest multiple of `tp_size` that holds `seq_len` tokens.

    Sequence parallelism gives TP rank r the r-th of tp_size equal sequence chunks, so the
    model pads a shorter sequence at its end; causal attention keeps the padding invisible to
    the real tokens, and the padded labels are ignored by the loss.
    """
    return seq_len + (-seq_len) % tp_size


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The smallest multiple of `tp_size` that holds `vocab_size` rows: the vocabulary the
    embedding and the LM head split, one equal block of rows per rank.

    Megatron pads to a multiple of `make_vocab_size_divisible_by` (128) times the TP size, for
    GEMM-friendly shapes; the split itself needs only the multiple of the TP size, which is
    what is used here. The padding rows (the last ranks' last rows) are zeros, never looked up
    by a valid id, masked out of the loss and the logits a user sees, and in no checkpoint.
    """
    return vocab_size + (-vocab_size) % tp_size


def pad_sequence(t, tp_size: int, value):
    """[s, ...] -> [s', ...], s' = padded_seq_len(s, tp_size), `value` in the new rows."""
    pad = padded_seq_len(t.shape[0], tp_size) - t.shape[0]
    if not pad:
        return t
    return torch.cat([t, t.new_full((pad, *t.shape[1:]), value)])


def check_seq_len(seq_len: int, max_seq_len: int) -> None:
    """The model takes any length from 1 to max_seq_len: the rotary tables stop there. (The
    Transformer pads a length the TP size does not divide, with `padded_seq_len`; the
    sequence-parallel layers on their own refuse one.)"""
    if not 1 <= seq_len <= max_seq_len:
        raise ValueError(f"sequence length {seq_len} must be between 1 and "
                         f"max_seq_len={max_seq_len}")
