"""Your model under TP against the same model on one device: the loss and every gradient.

The checks between the ranks (agreement.py, replicated_grads.py) catch ranks that differ from
each other. They cannot catch ranks that are all wrong the same way: a fused q|k|v projection
split as plain rows gives every rank the wrong heads, consistently. Only a comparison with one
device can, and it needs nothing from the model but a way to build it:

    report = compare_with_one_device(build_model, parallelize, batch, loss_fn, tp_group=group)
    print(report)                      # the loss, then every parameter, worst first
    assert report.ok, report

Inside every rank of the group: `build_model()` gives the full model (the same weights on every
rank: seed first); `parallelize(model, tp_group)` splits a copy of it; `loss_fn(model, batch)`
returns the scalar loss. Both models run from the same generator state (`seed`), so dropout
under a plan (whose masks are one device's) compares exactly too. Each rank compares its shard
of every gradient with the matching slice of the one-device gradient (the parameter's marks say
which, sharding.py); the worst error of each parameter over the ranks is what every rank reports.

The error is max |tp - one device| / max |one device| per tensor. fp32: within `tol` (TP only
changes the order of additions). bf16 (`dtype=torch.bfloat16`): both the TP model and the same
model on one device in bf16 are compared with the fp32 one-device model, and TP may be at most
twice as far from it as one device's bf16, plus one bf16 rounding (2^-8).
"""
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..guards.collectives import reduce_numbers
from ..parallel_linear import ColumnParallelLinear
from ..support.sharding import shard, tensor_parallel_rows

FP32_TOL = 1e-5
BF16_EPS = 2.0 ** -8


def relative_error(actual, expected):
    """max |actual - expected| / max |expected| (inf when the shapes differ)."""
    if tuple(actual.shape) != tuple(expected.shape):
        return float("inf")
    diff = (actual.detach().double() - expected.detach().double()).abs().max()
    return (diff / expected.detach().double().abs().max().clamp_min(1e-30)).item()


@dataclass
class Comparison:
    """What `compare_with_one_device` found; the same on every rank."""
    loss: float
    one_device_loss: float
    errors: dict  # "loss" and each parameter name -> relative error (worst over the ranks)
    allowed: dict  # the same keys -> the largest error that passes
    plain_column_layers: list = field(default_factory=list)  # split as plain rows

    @property
    def failures(self):
        """The keys above what they are allowed, worst first."""
        bad = [k for k, v in self.errors.items() if not v <= self.allowed[k]]
        return sorted(bad, key=lambda k: -self.errors[k])

    @property
    def ok(self):
        return not self.failures

    def __str__(self):
        lines = [f"loss: TP {self.loss:.6f}, one device {self.one_device_loss:.6f}"]
        for key in sorted(self.errors, key=lambda k: -self.errors[k]):
            mark = "ok" if self.errors[key] <= self.allowed[key] else "DIFFERS"
            lines.append(f"  {key}: {self.errors[key]:.3g} (allowed {self.allowed[key]:.3g}) "
                         f"{mark}")
        if self.ok:
            lines.append(f"loss and all {len(self.errors) - 1} gradients equal one device's")
            return "\n".join(lines)
        lines.append(f"{len(self.failures)} of {len(self.errors)} differ from one device's; "
                     f"worst: {self.failures[0]}")
        worst = {n: max((self.errors[f] for f in self.failures if f.startswith(n + ".")),
                        default=None) for n in self.plain_column_layers}
        suspects = sorted((n for n, e in worst.items() if e is not None), key=lambda n: -worst[n])
        if suspects:
            lines.append(f"split as plain rows: {', '.join(suspects)}; if one's output is "
                         f"several tensors side by side (a fused q|k|v, gate|up), declare it "
                         f"ColwiseParallel(output_shape=..., split_dim=...)")
        return "\n".join(lines)


def _run(model, batch, loss_fn, seed):
    torch.manual_seed(seed)  # the same generator state for dropout, on every model
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach().float().item()


def compare_with_one_device(build_model, parallelize, batch, loss_fn, *, tp_group=None,
                            seed=0, dtype=torch.float32, tol=FP32_TOL):
    """Build, split and run the model once beside one device's; returns a `Comparison`.
    Inside a rank; every rank of `tp_group` (None: the whole world) must call it."""
    group = tp_group if tp_group is not None else dist.group.WORLD
    torch.manual_seed(seed)
    reference = build_model()
    models = {"tp": parallelize(copy.deepcopy(reference).to(dtype), group)}
    if dtype != torch.float32:
        models["one device"] = copy.deepcopy(reference).to(dtype)
    ref_loss = _run(reference, batch, loss_fn, seed)
    losses = {k: _run(m, batch, loss_fn, seed) for k, m in models.items()}

    full = dict(reference.named_parameters())
    keys, errs = ["loss"], {k: [abs(v - ref_loss) / max(abs(ref_loss), 1e-30)]
                            for k, v in losses.items()}
    tp_params = dict(models["tp"].named_parameters())
    extra = sorted(set(tp_params) - set(full))
    if extra:  # a tie undone, or a parameter renamed: nothing to compare it with
        raise ValueError(f"the split model has parameters the one-device model has not: "
                         f"{extra}; a tied weight must stay one parameter")
    for name, ref in full.items():
        keys.append(name)
        for kind, m in models.items():
            param = tp_params[name] if kind == "tp" else dict(m.named_parameters())[name]
            if ref.grad is None or param.grad is None:
                errs[kind].append(0.0 if ref.grad is None and param.grad is None
                                  else float("inf"))
                continue
            want = shard(ref.grad, param, group) if kind == "tp" else ref.grad
            errs[kind].append(relative_error(param.grad, want))
    worst = {k: reduce_numbers(v, group, op=dist.ReduceOp.MAX) for k, v in errs.items()}
    errors = dict(zip(keys, worst["tp"]))
    if dtype == torch.float32:
        allowed = {k: tol for k in keys}
    else:
        allowed = {k: 2 * e + BF16_EPS for k, e in zip(keys, worst["one device"])}
    plain = [n for n, m in models["tp"].named_modules()
             if isinstance(m, ColumnParallelLinear) and tensor_parallel_rows(m.weight) is None]
    return Comparison(losses["tp"], ref_loss, errors, allowed, plain)


__all__ = ["Comparison", "compare_with_one_device", "relative_error"]
