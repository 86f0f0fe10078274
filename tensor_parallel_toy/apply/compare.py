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
returns the scalar loss. Each rank compares its shard of every gradient with the matching slice
of the one-device gradient (the parameter's marks say which, sharding.py); the worst error of
each parameter over the ranks is what every rank reports.

Randomness. Both models run from the same generator state (`seed`, which also restarts the TP
region's stream, random.py), so dropouts planned SequenceParallel (one device's masks) compare
exactly. A draw in the TP region (a dropout marked NoParallel between a column and its row
layer, `F.scaled_dot_product_attention(dropout_p=...)` on this rank's heads) comes from each
rank's own stream and differs from one device by design: the report then says so first, names
no layer, and the way to compare is `model.eval()` or dropout p = 0. A dropout_p inside a
function outside the TP region is not seen by the report.

Which layer. When gradients differ, the split model is run once more with the input of every
planned column layer set to one device's (its slice), and each row layer's input compared with
one device's: a region between them that still differs holds the fault, and its column layers
split as plain rows are named (a fused q|k|v or gate|up needs output_shape). Layers downstream
of a fault, whose gradients differ only because of it, are not named.

The error is max |tp - one device| / max |one device| per tensor. `dtype`: the precision the
models are compared in; None (the default) takes the built model's. fp32: within `tol` (TP only
changes the order of additions). bf16 (or fp16): the TP model and the same model on one device
in that dtype are both compared with the model in fp32, and TP may be at most twice as far from
it as one device, plus one bf16 rounding (2^-8). A model built in bf16 is compared that way
(its fp32 copy is exact); floating tensors of `batch` must suit the fp32 model too.
"""
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..guards.collectives import reduce_numbers
from ..parallel_linear import ColumnParallelLinear, layout_of, shard
from ..support.sharding import layouts
from .layers import PlannedColumn, PlannedRow
from .random import random_stream

FP32_TOL = 1e-5
BF16_EPS = 2.0 ** -8
# A row layer's input this far from one device's (given one device's inputs to the region's
# column layers) is a fault, not rounding: a wrong split gives errors of order 1.
REGION_TOL = {torch.float32: 1e-3}
REGION_TOL_LOW_PRECISION = 0.1


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
    plain_column_layers: list = field(default_factory=list)  # split as plain rows, at fault
    randomness: str = ""  # why the runs' random draws differ, said first ("": they do not)

    @property
    def failures(self):
        """The keys above what they are allowed, worst first."""
        bad = [k for k, v in self.errors.items() if not v <= self.allowed[k]]
        return sorted(bad, key=lambda k: -self.errors[k])

    @property
    def ok(self):
        return not self.failures

    def __str__(self):
        lines = [self.randomness] if self.randomness else []
        lines.append(f"loss: TP {self.loss:.6f}, one device {self.one_device_loss:.6f}")
        for key in sorted(self.errors, key=lambda k: -self.errors[k]):
            mark = "ok" if self.errors[key] <= self.allowed[key] else "DIFFERS"
            lines.append(f"  {key}: {self.errors[key]:.3g} (allowed {self.allowed[key]:.3g}) "
                         f"{mark}")
        if self.ok:
            lines.append(f"loss and all {len(self.errors) - 1} gradients equal one device's")
            return "\n".join(lines)
        lines.append(f"{len(self.failures)} of {len(self.errors)} differ from one device's; "
                     f"worst: {self.failures[0]}")
        if self.plain_column_layers:
            lines.append(f"split as plain rows: {', '.join(self.plain_column_layers)}; if one's "
                         f"output is several tensors side by side (a fused q|k|v, gate|up), "
                         f"declare it ColwiseParallel(output_shape=..., split_dim=...)")
        return "\n".join(lines)


def _run(model, batch, loss_fn, seed):
    torch.manual_seed(seed)  # the same generator state for dropout, on every model
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach().float().item()


def _model_dtype(model):
    """The one floating dtype of `model`'s parameters (refused in one line when it has several)."""
    found = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
    if len(found) > 1:
        raise ValueError(f"the model holds parameters of dtypes {found}; give "
                         f"compare_with_one_device dtype= (one of them) to compare in")
    return getattr(torch, found[0].split(".")[-1]) if found else torch.float32


def _randomness_note(stream_drew, model):
    """The report's first line about random draws ("" when there are none to speak of)."""
    if stream_drew:
        return ("randomness differs from one device by design: the tensor-parallel region (a "
                "split column layer's output until its row layer) drew from each rank's own "
                "stream (dropout there masks each rank's heads its own way); to compare, call "
                "model.eval() in build_model or set dropout p = 0")
    if model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return ("training mode with dropout p > 0: SequenceParallel dropouts draw one device's "
                "masks, so they compare exactly; a dropout_p inside a function outside the "
                "tensor-parallel region is not seen here (if in doubt: model.eval() or p = 0)")
    return ""


def _faulty_regions(reference, tp, batch, loss_fn, seed, group):
    """The column layers split as plain rows in a TP region whose row layer's input differs from
    one device's even when its column layers get one device's inputs; None when the split
    model has no planned layers to go by. Same on every rank."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    ref_layers = dict(reference.named_modules())
    planned = [(n, m) for n, m in tp.named_modules() if isinstance(m, (PlannedColumn, PlannedRow))]
    if not planned or any(n not in ref_layers for n, _ in planned):
        return None
    seen, events, handles = {n: [] for n, _ in planned}, [], []

    def record(name):
        return lambda mod, args: seen[name].append(args[0].detach().float())

    def one_devices(name, layer, x):  # one device's input to `layer`, as this rank holds it
        full = seen[name][sum(1 for e in events if e[1] == name)]
        if isinstance(layer, PlannedRow):
            full = full.chunk(p, dim=-1)[rank]
        elif layer.input_dim is not None:
            full = full.chunk(p, dim=layer.input_dim)[rank]
        return full.to(x.dtype)

    def force(name):
        def hook(layer, args):
            want = one_devices(name, layer, args[0])
            error = relative_error(args[0], want) if isinstance(layer, PlannedRow) else 0.0
            events.append((isinstance(layer, PlannedRow), name, error))
            return (want,) + tuple(args[1:])
        return hook

    try:
        handles = [ref_layers[n].register_forward_pre_hook(record(n)) for n, _ in planned]
        with torch.no_grad():
            torch.manual_seed(seed)
            loss_fn(reference, batch)
            for h in handles:
                h.remove()
            handles = [m.register_forward_pre_hook(force(n)) for n, m in planned]
            torch.manual_seed(seed)
            loss_fn(tp, batch)
    finally:
        for h in handles:
            h.remove()
    errors = reduce_numbers([e for is_row, _, e in events if is_row] or [0.0], group,
                            op=dist.ReduceOp.MAX)
    tol = REGION_TOL.get(next(tp.parameters()).dtype, REGION_TOL_LOW_PRECISION)
    modules, suspects, region, rows = dict(planned), [], [], iter(errors)
    for is_row, name, _ in events:
        if not is_row:
            if not modules[name].gather_output:
                region.append(name)
            continue
        if next(rows) > tol:
            suspects += [n for n in region if n not in suspects and
                         layout_of(modules[n], "weight").rows is None]
        region = []
    return suspects


def compare_with_one_device(build_model, parallelize, batch, loss_fn, *, tp_group=None,
                            seed=0, dtype=None, tol=FP32_TOL):
    """Build, split and run the model once beside one device's; returns a `Comparison`.
    Inside a rank; every rank of `tp_group` (None: the whole world) must call it.

    build_model() -> the full model (same weights on every rank); parallelize(model, group) ->
    the split model; loss_fn(model, batch) -> the scalar loss. `seed`: the generator state each
    run starts from (the TP region's stream too). `dtype`: the precision compared in (None: the
    built model's; bf16 / fp16 are compared against the model in fp32, see the module
    docstring). `tol`: the largest fp32 relative error that passes.
    """
    group = tp_group if tp_group is not None else dist.group.WORLD
    torch.manual_seed(seed)
    reference = build_model()
    dtype = _model_dtype(reference) if dtype is None else dtype
    if any(p.dtype in (torch.bfloat16, torch.float16) for p in reference.parameters()):
        reference = reference.float()  # its fp32 copy is exact: the yardstick
    models = {"tp": parallelize(copy.deepcopy(reference).to(dtype), group)}
    if dtype != torch.float32:
        models["one device"] = copy.deepcopy(reference).to(dtype)
    stream = random_stream(group, seed)  # restarted: the report is the same on every call
    since = {k: v.clone() for k, v in stream.states.items()} if stream else {}
    ref_loss = _run(reference, batch, loss_fn, seed)
    losses = {k: _run(m, batch, loss_fn, seed) for k, m in models.items()}
    stream_drew = stream is not None and stream.drew(since)

    full = dict(reference.named_parameters())
    keys, errs = ["loss"], {k: [abs(v - ref_loss) / max(abs(ref_loss), 1e-30)]
                            for k, v in losses.items()}
    tp_params = dict(models["tp"].named_parameters())
    tp_layouts = layouts(models["tp"])
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
            want = shard(ref.grad, tp_layouts[name], group) if kind == "tp" else ref.grad
            errs[kind].append(relative_error(param.grad, want))
    worst = {k: reduce_numbers(v, group, op=dist.ReduceOp.MAX) for k, v in errs.items()}
    errors = dict(zip(keys, worst["tp"]))
    if dtype == torch.float32:
        allowed = {k: tol for k in keys}
    else:
        allowed = {k: 2 * e + BF16_EPS for k, e in zip(keys, worst["one device"])}
    result = Comparison(losses["tp"], ref_loss, errors, allowed,
                        randomness=_randomness_note(stream_drew, reference))
    if result.ok or stream_drew:  # randomness would be blamed on whichever layer drew it
        return result
    found = _faulty_regions(reference, models["tp"], batch, loss_fn, seed, group)
    if found is None:  # not split by a plan: the plain column layers whose gradients differ
        found = [n for n, m in models["tp"].named_modules()
                 if isinstance(m, ColumnParallelLinear) and layout_of(m, "weight").rows is None
                 and any(f.startswith(n + ".") for f in result.failures)]
    blame = {n: max((errors[f] for f in result.failures if f.startswith(n + ".")), default=0)
             for n in found}  # worst first
    result.plain_column_layers = sorted(found, key=lambda n: -blame[n])
    return result


__all__ = ["Comparison", "compare_with_one_device", "relative_error"]
