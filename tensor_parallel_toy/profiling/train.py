"""One training run of one mode on this rank, with the metrics the profile reports per step.

Modes (the same network, initial weights, data and optimizer in all four):
    baseline    `Transformer(config)` on one rank, plain nn.Linear, no communication
    tp          hand-written TP + SP layers, collectives called whole
    tp_overlap  the same layers with the ring overlap (`overlap=True`)
    dtensor     the baseline model parallelized by PyTorch DTensor (see dtensor_tp.py)

A step is: forward, loss, backward, (dtensor: reduce the partial gradients), gradient norm,
AdamW step, zero_grad. Its time is taken from a barrier (every rank starts together) to the
end of the optimizer step with the device synchronized; the step's time is the slowest rank's.
"""
import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist

from .. import dtensor_tp
from ..initialize import current_device
from ..model import Transformer
from ..sharding import grad_norm
from . import data
from .metrics import SavedActivationBytes, now, state_bytes
from .output import atomic_path
from .spec import MODES


@functools.lru_cache(maxsize=4)
def _corpus(seed):
    return data.make_corpus(seed=seed)


def build_model(mode, config, group, device, dtype, seed):
    if mode == "baseline":
        return Transformer(config, seed=seed).to(device, dtype)
    if mode in ("tp", "tp_overlap"):
        model = Transformer(config, tp_group=group, overlap=mode == "tp_overlap", seed=seed)
        return model.to(device, dtype)
    if mode == "dtensor":
        return dtensor_tp.parallelize(Transformer(config, seed=seed).to(device, dtype), group,
                                      device.type)
    raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")


LR_WARMUP_STEPS = 10  # Adam's first updates are large: without a ramp the loss spikes early


def make_optimizer(model, lr):
    """AdamW with a linear learning-rate ramp over the first LR_WARMUP_STEPS steps (the
    scheduler steps inside the optimizer's step, see `train_step`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    optimizer.schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / LR_WARMUP_STEPS))
    return optimizer


def train_step(mode, model, optimizer, ids, labels, group, meter=None):
    """One optimizer step. Returns (loss, grad norm, state bytes or None). `meter`, if given,
    is entered around forward + backward to count the activations saved for backward."""
    with meter or contextlib.nullcontext():
        if mode == "dtensor":
            loss = dtensor_tp.loss_and_backward(model, ids, labels)
        else:
            loss = model.loss(ids, labels)
            loss.backward()
    if mode == "dtensor":
        dtensor_tp.reduce_partial_grads(model)
        norm = dtensor_tp.grad_norm(model, group)
    else:
        norm = grad_norm(model, None if mode == "baseline" else group)
    optimizer.step()
    optimizer.schedule.step()
    # After the step (AdamW creates its state in the first one), before the grads are cleared.
    sizes = state_bytes(model, optimizer) if meter is not None else None
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), norm, sizes


class _Progress:
    """One line per mode on rank 0, rewritten in place on a terminal."""

    def __init__(self, mode, steps, enabled):
        self.mode, self.steps = mode, steps
        self.enabled = enabled
        self.tty = sys.stdout.isatty()

    def update(self, step, loss, seconds):
        if not self.enabled:
            return
        line = (f"  {self.mode:<10} step {step + 1:>3}/{self.steps}  loss {loss:7.4f}  "
                f"{seconds * 1e3:8.1f} ms/step")
        if self.tty:
            print("\r" + line, end="\n" if step + 1 == self.steps else "", flush=True)
        elif (step + 1) % max(1, self.steps // 4) == 0 or step + 1 == self.steps:
            print(line, flush=True)


def run_mode(mode, spec):
    """Train `mode` for spec.steps steps on this rank (spec: a ProfileSpec); every rank of the
    TP group calls it.
    Returns this rank's per-step lists (loss, grad_norm, step_time_s) and memory, or None on
    ranks that take no part (the baseline runs on rank 0 alone)."""
    group = dist.group.WORLD if dist.is_initialized() else None
    rank = dist.get_rank() if group is not None else 0
    if mode == "baseline" and rank != 0:
        return None
    threads = torch.get_num_threads()
    if mode == "baseline":  # the other ranks sit idle: give it the whole machine
        torch.set_num_threads(spec.baseline_threads)
    try:
        return _train(mode, spec, group, rank)
    finally:
        torch.set_num_threads(threads)


def _train(mode, spec, group, rank):
    device, dtype = current_device(), spec.torch_dtype
    model = build_model(mode, spec.config, group, device, dtype, spec.seed)
    optimizer = make_optimizer(model, spec.lr)
    corpus = _corpus(spec.seed)
    aligned = mode != "baseline" and group is not None
    progress = _Progress(mode, spec.steps, spec.progress and rank == 0)
    out = {"rank": rank, "threads": torch.get_num_threads(), "loss": [], "grad_norm": [],
           "step_time_s": []}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(spec.steps):
        ids, labels = (t.to(device) for t in data.batch(corpus, step, spec.batch, spec.seq,
                                                        spec.seed))
        meter = SavedActivationBytes(model) if step == 0 else None  # step 0 is warm-up
        if aligned:
            dist.barrier(group=group)
        start = now(device)
        loss, norm, sizes = train_step(mode, model, optimizer, ids, labels, group, meter)
        seconds = now(device) - start
        if sizes is not None:
            out["memory"] = {**sizes, "saved_activation_bytes": meter.bytes,
                             "saved_activation_storages": meter.count}
        out["loss"].append(loss)
        out["grad_norm"].append(norm)
        out["step_time_s"].append(seconds)
        progress.update(step, loss, seconds)
    if device.type == "cuda":
        out["memory"]["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    if spec.trace_dir and mode != "baseline":
        _export_trace(mode, model, optimizer, corpus, spec, group, rank, device)
    return out


def _export_trace(mode, model, optimizer, corpus, spec, group, rank, device):
    """One extra step under torch.profiler, saved as a Chrome trace (opens in Perfetto)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    ids, labels = (t.to(device) for t in data.batch(corpus, spec.steps, spec.batch, spec.seq,
                                                    spec.seed))
    with profile(activities=activities) as prof:
        train_step(mode, model, optimizer, ids, labels, group)
    with atomic_path(os.path.join(spec.trace_dir, f"trace_{mode}_rank{rank}.json")) as tmp:
        prof.export_chrome_trace(tmp)
