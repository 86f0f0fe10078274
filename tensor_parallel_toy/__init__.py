"""tensor_parallel_toy: Megatron-style tensor + sequence parallelism with hand-written autograd.

The idea is in the package's top files, read in this order: comm.py (the collectives and the
region Functions), ring.py (the overlap), parallel_linear.py (the column and row layers),
vocab_parallel.py (embedding and loss over a split vocabulary), model.py (the Transformer).
The rest lives in named sub-packages beside it:

    guards/     what makes a distributed run trustworthy: the ranks agree on the model and the
                batch, ids in range, replicated gradients equal; attached to the layers and the
                model from outside
    apply/      tensor parallelism for a model of your own
    interop/    PyTorch DTensor, FSDP2 / DDP, Hugging Face checkpoints
    launcher/   process groups, the local worker pool, torchrun, the GPU check
    support/    parameter metadata (what is split along which dim), full tensors <-> shards,
                the GEMM helpers of the overlapped layers

`profiling/` is the harness behind `python -m tensor_parallel_toy profile`, `post/` builds the
blog post, `tests/` is the specification. Arrows run only from those into the library.

What this file exports are the checked versions: `ColumnParallelLinear`, `RowParallelLinear`,
`VocabParallelEmbedding` and `vocab_parallel_cross_entropy` as in the reading path, with the
guards attached (guards/checked.py); `Transformer` carries them itself (one line in model.py).
"""
import importlib
import sys

from .apply.classic_tp import apply_tensor_parallel, sync_replicated_gradients
from .apply import compare_with_one_device, parallelize_module
from .config import ModelConfig, RopeScaling
from .guards.checked import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                             vocab_parallel_cross_entropy)
from .interop.dtensor_tp import parallelize_hf_model
from .interop.hf_checkpoint import from_hf, to_hf
from .launcher.initialize import WorkerPool, init_from_env, launch, shutdown
from .model import Transformer
from .parallel_linear import column_parallel_linear, row_parallel_linear
from .support.sharding import grad_norm

# The modules' homes before the guards, interop and launcher moved beside the reading path:
# `import tensor_parallel_toy.initialize` and the like keep working in scripts written then.
for _old, _new in {"agreement": "guards.agreement", "batch": "guards.batch",
                   "replicated_grads": "guards.replicated_grads", "classic_tp": "apply.classic_tp",
                   "data_parallel": "interop.data_parallel", "dtensor_tp": "interop.dtensor_tp",
                   "hf_checkpoint": "interop.hf_checkpoint", "initialize": "launcher.initialize",
                   "gpu_check": "launcher.gpu_check", "sharding": "support.sharding"}.items():
    sys.modules[f"{__name__}.{_old}"] = importlib.import_module(f"{__name__}.{_new}")

__all__ = ["ColumnParallelLinear", "ModelConfig", "RopeScaling", "RowParallelLinear",
           "Transformer", "VocabParallelEmbedding", "WorkerPool", "apply_tensor_parallel",
           "column_parallel_linear", "compare_with_one_device", "from_hf", "grad_norm",
           "init_from_env", "launch", "parallelize_hf_model", "parallelize_module",
           "row_parallel_linear", "shutdown", "sync_replicated_gradients", "to_hf",
           "vocab_parallel_cross_entropy"]
