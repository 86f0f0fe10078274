"""ModelConfig: the shape of the transformer, checked once, up front.

Every size the tensor-parallel layers split must divide by the TP size. We check that here,
before any process group or collective exists, so a bad size is one clear line instead of a
shape error inside a matmul on rank 3.
"""
from dataclasses import dataclass
from typing import Optional

MLP_KINDS = ("gelu", "swiglu")


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

    def __post_init__(self):
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)  # frozen: set it once here
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                     "ffn_hidden_size", "max_seq_len", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} must be a bool")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"ModelConfig.mlp={self.mlp!r}: valid values are {MLP_KINDS}")
        for name in ("norm_eps", "rope_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive number")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} (hidden_size/num_heads) must be even for rotary "
                f"embeddings; choose hidden_size and num_heads so that it is")
        if self.num_heads % self.num_kv_heads:
            valid = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(f"num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.num_kv_heads}; valid num_kv_heads: {valid}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def check_tp_size(self, tp_size: int) -> None:
        """Raise one clear error if this model cannot be split over `tp_size` ranks."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor-parallel size {tp_size!r} must be a positive integer")
        for name in ("hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"):
            value = getattr(self, name)
            if value % tp_size:
                valid = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
                raise ValueError(
                    f"{name}={value} is not divisible by the tensor-parallel size {tp_size}; "
                    f"valid TP sizes for it: {valid}")
        # K/V heads are split when there are at least as many as ranks, and replicated (each
        # rank using one) when there are fewer: either way each rank's query heads must find
        # all their k/v heads on that rank, which needs one of the two to divide the other.
        kv = self.num_kv_heads
        if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
            valid = sorted({d for d in range(1, self.num_heads + 1)
                            if self.num_heads % d == 0 and (d % kv == 0 or kv % d == 0)})
            raise ValueError(
                f"num_kv_heads={kv} does not fit the tensor-parallel size {tp_size}: it must "
                f"be a multiple of it (k/v heads split) or divide it (k/v heads replicated); "
                f"valid TP sizes for it: {valid}")


def padded_seq_len(seq_len: int, tp_size: int) -> int:
    """The smallest multiple of `tp_size` that holds `seq_len` tokens.

    Sequence parallelism gives TP rank r the r-th of tp_size equal sequence chunks, so the
    model pads a shorter sequence at its end; causal attention keeps the padding invisible to
    the real tokens, and the padded labels are ignored by the loss.
    """
    return seq_len + (-seq_len) % tp_size


def check_seq_len(seq_len: int, tp_size: int, max_seq_len: int) -> None:
    """The model takes any length from 1 to max_seq_len (it pads to a multiple of tp_size).

    The sequence-parallel layers themselves still need a multiple of the TP size; they raise
    their own error when given anything else.
    """
    if not 1 <= seq_len <= max_seq_len:
        raise ValueError(f"sequence length {seq_len} must be between 1 and "
                         f"max_seq_len={max_seq_len}")
