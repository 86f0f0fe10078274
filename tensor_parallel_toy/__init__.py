"""tensor_parallel_toy: Megatron-style tensor + sequence parallelism with hand-written autograd."""
from .any_model import apply_tensor_parallel, sync_replicated_gradients
from .config import ModelConfig
from .model import Transformer
from .parallel_linear import ColumnParallelLinear, RowParallelLinear
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "ModelConfig", "RowParallelLinear", "Transformer",
           "VocabParallelEmbedding", "apply_tensor_parallel", "sync_replicated_gradients",
           "vocab_parallel_cross_entropy"]
