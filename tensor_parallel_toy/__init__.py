"""tensor_parallel_toy: Megatron-style tensor + sequence parallelism with hand-written autograd."""
from .config import ModelConfig
from .model import Transformer
from .parallel_linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "ModelConfig", "RowParallelLinear", "Transformer"]
