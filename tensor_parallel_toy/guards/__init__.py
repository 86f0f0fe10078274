"""The checks that make a distributed run trustworthy, attached to a model from outside by one
call, `guard(model)` (guard.py); what it compares lives in agreement.py (the model and the
batch), batch.py (a batch's shape, ids and labels) and replicated_grads.py (gradients)."""
from .agreement import RanksDisagreeError
from .guard import Guards, guard
from .replicated_grads import ReplicatedGradientsDisagreeError, check_replicated_gradients

__all__ = ["Guards", "RanksDisagreeError", "ReplicatedGradientsDisagreeError",
           "check_replicated_gradients", "guard"]
