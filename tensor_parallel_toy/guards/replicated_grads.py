"""Replicated parameters must end a backward with the same gradient on every rank: checked.

Every rank of a TP group holds a whole copy of each replicated parameter (a norm weight, a
bias added after the sum, a layer outside the split blocks) and applies the same optimizer step
to it, so the copies stay equal only if their gradients are equal. They are, when the
parameter sees the same inputs on every rank, or when its gradient is summed over the group
where each rank sees only part of them: the norms under sequence parallelism (s/p tokens per
rank), Qwen3's per-head q/k norms inside the tensor-parallel region (heads/p heads per rank).
Forget the sum and nothing fails: the loss and the logits are right, each rank's gradient is a
partial sum, the copies drift apart step by step.

`check_replicated_gradients(model, tp_group)` catches the whole class after a backward, in one
small collective. Each rank reduces every replicated gradient g (n numbers) to a digest of
five float64s,

    [kind, ||g||, sum_i g_i, sum_i g_i cos(i phi), sum_i g_i sin(i phi)]

(kind: no gradient, a finite one, or one holding an inf or NaN, whose other entries are then
zeros: copies that all overflowed agree, a rank that overflowed alone does not; phi = 0.618...,
the golden ratio's fractional part, in radians: the weights differ at every position, so a
gradient whose entries are moved or permuted changes the digest), and the ranks all-gather the
digests: 40 bytes per parameter per rank. Every rank then reaches the same verdict from the same numbers, so a disagreement
raises on every rank, naming the first parameter whose ranks differ.

The tolerance. Correct replicas are bit-equal here (one all-reduce gives every rank the same
sum) or differ by rounding, a relative u per element (u ~ 1e-7 in fp32). Each digest entry is a
sum of g_i w_i with |w_i| <= 1, so rounding moves it by at most sqrt(n) u ||g||, below
`TOLERANCE` * ||g|| = 2^-4 ||g|| for any fp32 tensor under 10^11 elements; in bf16 (u = 2^-8)
that worst case stays below it up to 256 elements, and rounding errors of random sign move an
entry by about u ||g||, 16 times less than the tolerance, at any size. A gradient left as
per-rank partial sums differs between ranks by about its own norm: 16 times the tolerance.

Which parameters are compared: those no rank splits, read from their modules' layouts
(sharding.py: a `Layout` whose `dim` is None) and, for DTensor parameters, from the placement on the TP group's mesh
dimension. A DTensor gradient placed `Partial()` (the sequence-parallel norms of a DTensor plan
before `reduce_partial_grads`) is left out: DTensor knows it is partial and sums it when it is
read; the trap is a parameter nobody knows about. A DTensor on a mesh without the TP group
(FSDP's data-parallel shards of our model) is compared by its local shard, the same one on every
TP rank of a data-parallel coordinate.

`watch_replicated_gradients(model, tp_group, every)` runs the check at the end of a backward
through `model`: after the first one (`every="first"`), or after backwards 1, N+1, 2N+1, ...
(`every=N`). `Transformer`, `classic_tp.apply_tensor_parallel`,
`dtensor_tp.parallelize_transformer` and `dtensor_tp.parallelize_hf_model` take it as their
`check_replicated_grads` option (off by default). Every rank of the group must watch with the
same `every` and the same parameter names, or the ranks' collectives do not pair (the
`Transformer` compares the option with the rest of its construction fingerprint). Under FSDP2
call `check_replicated_gradients` after backward (it compares the data-parallel shards, tested
on a 2 x 2 grid): the watch's end-of-backward callback is not ordered against FSDP2's own
end-of-backward work (on a GPU, the gradient reduce-scatters on FSDP2's streams).
"""
import math

import torch
from torch.distributed.tensor import DTensor, Partial, Shard

from .agreement import RanksDisagreeError, by_value, digest
from .collectives import group_device
from ..comm import all_gather_dim, group_size
from ..support.sharding import named_layouts

TOLERANCE = 2.0 ** -4  # relative to the gradient's norm: see the module docstring
_PHASE = (math.sqrt(5) - 1) / 2  # radians per position of the cos/sin weights
_DIGEST = 5  # numbers per parameter: kind, norm, sum, cos-weighted, sin-weighted sum
_KINDS = ("no gradient", "a finite gradient", "a non-finite gradient")  # the kind column
EVERY_VALID = ("None (off), 'first' (after the first backward) or a positive int N (after "
               "backwards 1, N+1, 2N+1, ...)")


class ReplicatedGradientsDisagreeError(RanksDisagreeError):
    """The ranks of a TP group ended a backward with different gradients of a replicated
    parameter: their copies would drift apart at the next optimizer step."""


def check_every_option(every, name="check_replicated_grads"):
    """Refuse, in one line, an `every` that is none of None, "first", a positive int."""
    if every is None or every == "first":
        return
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{name}={every!r}: valid are {EVERY_VALID}")


def _tp_placement(param, tp_group):
    """The placement of a DTensor `param` on the mesh dimension of `tp_group`, None when its
    mesh has no such dimension (then it is replicated over TP, e.g. FSDP's dp shards)."""
    mesh = param.device_mesh
    for dim in range(mesh.ndim):
        if mesh.get_group(dim) == tp_group:
            return param.placements[dim]
    return None


def replicated_gradients(model, tp_group):
    """(name, local gradient or None) of every parameter that every rank of `tp_group` holds
    whole, in the order of `named_parameters`, leaving out gradients DTensor marks `Partial()`
    on the TP dimension (summed by DTensor when read)."""
    out = []
    for name, param, layout in named_layouts(model):
        if layout.dim is not None:
            continue
        grad = param.grad
        if isinstance(param, DTensor):
            placement = _tp_placement(param, tp_group)
            if isinstance(placement, Shard):
                continue
            if isinstance(grad, DTensor):
                grad_placement = _tp_placement(grad, tp_group)
                if isinstance(grad_placement, Partial):
                    continue
        out.append((name, grad.to_local() if isinstance(grad, DTensor) else grad))
    return out


@torch.no_grad()
def gradient_digests(grads):
    """[k, 5] float64, one digest row per gradient, on the gradients' device: no host read
    here. Column 0 is the gradient's kind (an index into _KINDS): None gives a row of zeros; a
    gradient holding an inf or a NaN gives kind 2 and zeros, so that ranks whose copies all
    overflowed agree (nothing to compare; a loss scaler skips such a step), while a rank that
    overflowed alone disagrees with the others by its kind."""
    device = next((g.device for g in grads if g is not None), torch.device("cpu"))
    rows, weights = [], {}
    for grad in grads:
        if grad is None:
            rows.append(torch.zeros(_DIGEST, dtype=torch.float64, device=device))
            continue
        flat = grad.detach().reshape(-1).to(device, torch.float64)
        n = flat.numel()
        if n not in weights:  # [3, n]: ones, cos(i phi), sin(i phi)
            phase = torch.arange(n, dtype=torch.float64, device=device) * _PHASE
            weights[n] = torch.stack([torch.ones_like(phase), phase.cos(), phase.sin()])
        finite = torch.isfinite(flat).all()
        stats = torch.cat([flat.norm().reshape(1), weights[n] @ flat])
        stats = torch.where(finite, stats, torch.zeros_like(stats))
        rows.append(torch.cat([(2 - finite.double()).reshape(1), stats]))
    return torch.stack(rows) if rows else torch.zeros(0, _DIGEST, dtype=torch.float64)


def check_replicated_gradients(model, tp_group, tolerance=TOLERANCE):
    """Raise `ReplicatedGradientsDisagreeError` on every rank of `tp_group` if some replicated
    parameter of `model` has gradients that differ between the ranks by more than `tolerance`
    times their norm, naming the first such parameter. Returns how many were compared.

    Cost: a digest of each replicated gradient (a few passes over it), one all-gather of
    (1 + 5 k) float64s per rank for k parameters, one host read of the result. Every rank must
    call it at the same point (it is a collective); a group of one rank returns at once.
    """
    p = group_size(tp_group)
    if p == 1:
        return 0
    named = replicated_gradients(model, tp_group)
    names = [name for name, _ in named]
    device = group_device(tp_group)
    header = torch.zeros(1, _DIGEST, dtype=torch.float64)
    header[0, 0] = len(names)
    header[0, 1] = digest({"names": names}) % 2 ** 52  # exact in a float64
    digests = gradient_digests([g for _, g in named])
    mine = torch.cat([header.to(digests.device), digests]).to(device)  # [1 + k, 5]
    every = all_gather_dim(mine.unsqueeze(0), 0, tp_group).cpu()  # [p, 1 + k, 5]
    if not bool((every[:, 0] == every[0, 0]).all()):
        raise ReplicatedGradientsDisagreeError(
            f"the {p} ranks of the tensor-parallel group hold different replicated parameters "
            f"(counts: {by_value(every[:, 0, 0].long().tolist())}); every rank must build the "
            f"same model")
    rows = every[:, 1:]  # [p, k, 5]
    spread = rows.max(dim=0).values - rows.min(dim=0).values  # [k, 5]
    allowed = tolerance * rows[:, :, 1].max(dim=0).values  # [k]: relative to the largest norm
    differ = ~(spread[:, 1:] <= allowed[:, None]).all(dim=1) | (spread[:, 0] != 0)
    if bool(differ.any()):
        first = int(differ.nonzero()[0, 0])
        _raise_for(names[first], rows[:, first], int(differ.sum()), len(names), p)
    return len(names)


def _raise_for(name, rows, n_differ, n, p):
    """rows [p, 5]: one parameter's digest on each rank."""
    if len(set(rows[:, 0].tolist())) > 1:
        what = by_value([_KINDS[int(kind)] for kind in rows[:, 0].tolist()])
    else:
        norms = by_value([f"{v:.6g}" for v in rows[:, 1].tolist()])
        sums = by_value([f"{v:.6g}" for v in rows[:, 2].tolist()])
        what = f"gradient norm {norms}; sum {sums}"
    others = f"; {n_differ - 1} more of the {n} replicated parameters differ" if n_differ > 1 else ""
    raise ReplicatedGradientsDisagreeError(
        f"replicated parameter {name!r} has different gradients on the {p} ranks of the "
        f"tensor-parallel group ({what}){others}: a replicated weight applied to each rank's "
        f"part of the data (its tokens, its heads) needs its gradient summed over the group "
        f"(through f, or a SequenceParallel entry in a DTensor plan); else the copies drift "
        f"apart")


class ReplicatedGradientsWatch:
    """The hooks of `watch_replicated_gradients`: `backwards` (seen), `checks` (run),
    `compared` (parameters compared by the last check), `remove()`."""

    def __init__(self, model, tp_group, every):
        self.model, self.tp_group, self.every = model, tp_group, every
        self.backwards = self.checks = self.compared = 0
        self._queued = False
        self._handles = [model.register_forward_pre_hook(self._on_forward_start),
                         model.register_forward_hook(self._on_forward_end)]

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_forward_start(self, module, args):
        self._queued = False  # a backward that failed never ran its end-of-backward callback

    def _on_forward_end(self, module, args, output):
        # The first tensor of the output that backward will reach: its hook runs when a
        # backward through this model starts, and queues the check for that backward's end.
        tensor = _first_tensor_requiring_grad(output)
        if tensor is not None:
            tensor.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad):
        if not self._queued:
            self._queued = True
            # Runs once the whole backward is done (every .grad written), as DDP's does.
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self):
        self._queued = False
        self.backwards += 1
        due = self.backwards == 1 if self.every == "first" else (
            (self.backwards - 1) % self.every == 0)
        if not due:
            return
        self.checks += 1
        if self.every == "first":
            self.remove()  # nothing left to do: the hooks cost nothing from here on
        self.compared = check_replicated_gradients(self.model, self.tp_group)


def _first_tensor_requiring_grad(output):
    """A tensor, a tuple or list, a dict (a Hugging Face ModelOutput is one): the first tensor
    in it that requires grad, or None."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else (
        output if isinstance(output, (tuple, list)) else ())
    for value in values:
        found = _first_tensor_requiring_grad(value)
        if found is not None:
            return found
    return None


def watch_replicated_gradients(model, tp_group, every="first"):
    """Check the replicated gradients of `model` (`check_replicated_gradients`) at the end of a
    backward that runs through its output: after the first (`every="first"`), or after
    backwards 1, N+1, 2N+1, ... (`every=N`); None does nothing. Returns the watch (`.checks`,
    `.remove()`), or None. A group of one rank is never watched."""
    check_every_option(every, "every")
    if every is None or group_size(tp_group) == 1:
        return None
    return ReplicatedGradientsWatch(model, tp_group, every)
