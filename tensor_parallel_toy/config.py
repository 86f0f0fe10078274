"""ModelConfig: the shape of the transformer, checked once, up front.

Every size the tensor-parallel layers split must divide by the TP size. We check that here,
before any process group or collective exists, so a bad size is one clear line instead of a
shape error inside a matmul on rank 3.
"""
from dataclasses import dataclass


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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                     "ffn_hidden_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} (hidden_size/num_heads) must be even for rotary "
                f"embeddings; choose hidden_size and num_heads so that it is")

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


def check_seq_len(seq_len: int, tp_size: int, max_seq_len: int) -> None:
    """Sequence parallelism gives TP rank r the r-th of tp_size equal sequence chunks."""
    if seq_len < 1 or seq_len > max_seq_len:
        raise ValueError(f"sequence length {seq_len} must be between 1 and "
                         f"max_seq_len={max_seq_len}")
    if seq_len % tp_size:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by the tensor-parallel size {tp_size}; "
            f"use a multiple of {tp_size} (e.g. {seq_len + (-seq_len) % tp_size})")
