"""Tensor parallelism applied to a model of your own: a plan in PyTorch's words (its styles in
styles.py, read and carried out by plan.py), classic TP's plan read from the blocks' own
declarations (classic_tp.py) and the check against one device (compare.py)."""
from .classic_tp import apply_tensor_parallel, classic_plan, sync_replicated_gradients
from .compare import Comparison, compare_with_one_device
from .plan import matching_modules, parallelize_module, resolve_plan
from .styles import (ColwiseParallel, NoParallel, NormOverSplit, PrepareModuleInput,
                     PrepareModuleOutput, RowwiseParallel, SequenceParallel, rank_major_rows,
                     torch_plan)

__all__ = ["ColwiseParallel", "Comparison", "NoParallel", "NormOverSplit", "PrepareModuleInput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "apply_tensor_parallel",
           "classic_plan", "compare_with_one_device", "matching_modules", "parallelize_module",
           "rank_major_rows", "resolve_plan", "sync_replicated_gradients", "torch_plan"]
