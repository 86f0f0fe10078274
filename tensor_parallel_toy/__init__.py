"""tensor_parallel_toy: Megatron-style tensor + sequence parallelism with hand-written autograd.

The library is this folder; `profiling/` is the harness behind `python -m tensor_parallel_toy
profile`, and `tests/` the specification. Arrows run only from those two into the library.
"""
from .apply import compare_with_one_device, parallelize_module
from .classic_tp import apply_tensor_parallel, sync_replicated_gradients
from .config import ModelConfig, RopeScaling
from .dtensor_tp import parallelize_hf_model
from .hf_checkpoint import from_hf, to_hf
from .model import Transformer
from .parallel_linear import (ColumnParallelLinear, RowParallelLinear, column_parallel_linear,
                              row_parallel_linear)
from .sharding import grad_norm
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "ModelConfig", "RopeScaling", "RowParallelLinear",
           "Transformer", "VocabParallelEmbedding", "apply_tensor_parallel",
           "column_parallel_linear", "compare_with_one_device", "from_hf", "grad_norm",
           "parallelize_hf_model", "parallelize_module",
           "row_parallel_linear", "sync_replicated_gradients", "to_hf",
           "vocab_parallel_cross_entropy"]
