"""tensor_parallel_toy: Megatron-style tensor + sequence parallelism with hand-written autograd.

The idea is in the package's top files, read in this order: comm.py (the collectives and the
region Functions), parallel_linear.py (the column and row layers), vocab_parallel.py
(embedding and loss over a split vocabulary), model.py (the Transformer), and last ring.py
(the overlap).
They import nothing of the package but one another, config.py and rotary.py: a kernel. The
rest are its clients, in named sub-packages beside it:

    guards/     what makes a distributed run trustworthy, attached from outside by one call,
                `guard(model)`: the ranks agree on the model and the batch, ids in range,
                replicated gradients equal
    apply/      tensor parallelism for a model of your own (a plan; classic TP as a preset)
    interop/    PyTorch DTensor, FSDP2 / DDP, Hugging Face checkpoints and plans
    launcher/   process groups, the local worker pool, torchrun, the GPU check
    support/    full tensors <-> shards: checkpoints, full state dicts and gradients, the norm

`profiling/` is the harness behind `python -m tensor_parallel_toy profile`, `post/` builds the
blog post, `tests/` is the specification. Arrows run only from those into the library.
"""
from .apply.classic_tp import apply_tensor_parallel, sync_replicated_gradients
from .apply import compare_with_one_device, parallelize_module
from .config import ModelConfig, RopeScaling
from .guards import RanksDisagreeError, guard
from .interop.dtensor_tp import parallelize_hf_model
from .interop.hf_checkpoint import from_hf, to_hf
from .interop.hf_plan import hf_plan
from .launcher.initialize import current_device, init_from_env, shutdown
from .launcher.pool import WorkerPool, launch
from .model import Transformer
from .parallel_linear import (ColumnParallelLinear, RowParallelLinear, column_parallel_linear,
                              row_parallel_linear)
from .support.sharding import full_grads, full_state_dict, grad_norm, load_full_state_dict
from .vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "ModelConfig", "RanksDisagreeError", "RopeScaling",
           "RowParallelLinear", "Transformer", "VocabParallelEmbedding", "WorkerPool",
           "apply_tensor_parallel", "column_parallel_linear", "compare_with_one_device",
           "current_device",
           "from_hf", "full_grads", "full_state_dict", "grad_norm", "guard", "hf_plan",
           "init_from_env", "launch", "load_full_state_dict", "parallelize_hf_model", "parallelize_module",
           "row_parallel_linear", "shutdown", "sync_replicated_gradients", "to_hf",
           "vocab_parallel_cross_entropy"]
