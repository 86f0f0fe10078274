"""Tensor parallelism applied to a model of your own: a plan in PyTorch's words (plan.py) and
the check against one device (compare.py)."""
from .compare import Comparison, compare_with_one_device
from .plan import (ColwiseParallel, NoParallel, PrepareModuleInput, PrepareModuleOutput,
                   RowwiseParallel, SequenceParallel, matching_modules, parallelize_module,
                   rank_major_rows, resolve_plan, torch_plan)

__all__ = ["ColwiseParallel", "Comparison", "NoParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel",
           "compare_with_one_device", "matching_modules", "parallelize_module",
           "rank_major_rows", "resolve_plan", "torch_plan"]
