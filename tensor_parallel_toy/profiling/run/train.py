"""The training runs of the profile on this rank, every mode side by side, interleaved step by
step, with the metrics the profile reports per step.

Modes (the same network, initial weights, data and optimizer in all of them):
    baseline    `Transformer(config)` on one rank, plain nn.Linear, no communication
    tp          hand-written TP + SP layers, collectives called whole
    tp_overlap  the same layers with the ring overlap (`overlap=True`)
    tp_halves   the same layers, the batch run as two interleaved halves, each half's transfers
                under the other half's compute (`TransformerInHalves`, halves/)
    dtensor     the baseline model parallelized by PyTorch DTensor (see dtensor_tp.py)
    hf_dtensor  with a Llama-style config: a Hugging Face LlamaForCausalLM holding the
                baseline's weights, parallelized by PyTorch's plan for it (see hf_llama.py)

A step is: forward, loss, backward, (dtensor: reduce the partial gradients), gradient norm,
AdamW step, zero_grad. Its time is taken from a barrier (every rank starts together) to the
end of the optimizer step with the device synchronized; the step's time is the slowest rank's.

With `spec.dp > 1` the world is a dp x tp grid (`init_mesh_2d`) and tp, tp_overlap and dtensor
are 2-D: the same TP model inside each TP group, wrapped with FSDP2 (`apply_fsdp`) over the DP
group; each DP rank trains on its rows of the global batch (`split_batch`) with the
token-weighted loss (`data_parallel_loss`), so the loss and the gradients are the whole
batch's, as on the baseline, which still runs on rank 0 alone on the full batch.
"""
import contextlib
import functools
import os
import sys

import torch
import torch.distributed as dist

from ...comm import all_reduce_
from ...guards import guard
from ...guards.collectives import barrier
from ...halves import TransformerInHalves
from ...interop import dtensor_tp
from ...interop.data_parallel import apply_fsdp, data_parallel_loss, init_mesh_2d, split_batch
from ...launcher.initialize import current_device
from ...model import Transformer
from ...support.sharding import grad_norm
from ..measure.metrics import SavedActivationBytes, now, state_bytes
from ..report.output import atomic_path
from ..spec import MODES
from . import data, hf_llama


@functools.lru_cache(maxsize=4)
def _corpus(seed):
    return data.make_corpus(seed=seed)


@functools.lru_cache(maxsize=None)
def mesh_2d(dp, tp, device_type):
    """The dp x tp grid, made once per process: creating its groups is collective, and a
    DeviceMesh cannot free them, so every profile run in a worker pool reuses it."""
    return init_mesh_2d(dp, tp, device_type)


def build_model(mode, config, group, device, dtype, seed, mesh=None, check_replicated_grads=None,
                ring_pieces=1):
    """`group`: the TP group (1-D). `mesh`: the 2-D ("dp", "tp") grid, or None; given, the TP
    modes run over `mesh["tp"]` and are wrapped with FSDP2 over `mesh["dp"]`. `ring_pieces`: the
    tp_overlap mode's ring, its transfers per chunk.
    `check_replicated_grads`: the TP modes' guard (replicated_grads.py), 1-D only: its
    end-of-backward check is not ordered against FSDP2's own end-of-backward work."""
    grads_check = check_replicated_grads if mesh is None else None
    if mode == "baseline":
        return Transformer(config, seed=seed).to(device, dtype)
    if mode in ("tp", "tp_overlap", "tp_halves"):
        tp = group if mesh is None else mesh["tp"].get_group()  # the same group, from the grid
        if mode == "tp_halves":  # 1-D only (cli.py): FSDP2's units are the blocks it bypasses
            model = TransformerInHalves(config, tp_group=tp, seed=seed)
        else:
            model = Transformer(config, tp_group=tp, overlap=mode == "tp_overlap",
                                ring_pieces=ring_pieces, seed=seed)
        model = guard(model, check_replicated_grads=grads_check).to(device, dtype)
    elif mode == "dtensor":
        model = dtensor_tp.parallelize_transformer(Transformer(config, seed=seed).to(device, dtype),
                                       group if mesh is None else mesh["tp"], device.type,
                                       check_replicated_grads=grads_check)
    elif mode == "hf_dtensor":  # wrapped with FSDP2 there, if 2-D: its layers have HF names
        return hf_llama.build_hf_dtensor(config, seed, group, device, dtype, mesh, grads_check)
    else:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    return model if mesh is None else apply_fsdp(model, mesh)


LR_WARMUP_STEPS = 10  # Adam's first updates are large: without a ramp the loss spikes early


def make_optimizer(model, lr):
    """AdamW with a linear learning-rate ramp over the first LR_WARMUP_STEPS steps (the
    scheduler steps inside the optimizer's step, see `train_step`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    optimizer.schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / LR_WARMUP_STEPS))
    return optimizer


def train_step(mode, model, optimizer, ids, labels, group, meter=None, dp_group=None):
    """One optimizer step. Returns (loss, grad norm, state bytes or None). `meter`, if given,
    is entered around forward + backward to count the activations saved for backward.
    `dp_group` (a 2-D mode, `model` wrapped by FSDP2): ids and labels are this DP rank's rows,
    the loss returned is this rank's share (its mean over DP is the whole batch's)."""
    with meter or contextlib.nullcontext():
        if mode == "dtensor":
            loss = dtensor_tp.transformer_loss_and_backward(model, ids, labels)
        elif mode == "hf_dtensor":  # pads, and leaves the gradients reduced
            loss = hf_llama.loss_and_backward(model, ids, labels, dist.get_world_size(group))
        elif dp_group is not None:
            loss = data_parallel_loss(model, ids, labels, dp_group)
            loss.backward()
        else:
            loss = model.loss(ids, labels)
            loss.backward()
    if mode == "dtensor":
        dtensor_tp.reduce_partial_grads(model)
    if mode in ("dtensor", "hf_dtensor") and dp_group is not None:
        # Gradients on the 2-D mesh: get_total_norm reads the placements of both dimensions.
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        norm = norm.full_tensor().item()
    elif mode in ("dtensor", "hf_dtensor"):
        norm = dtensor_tp.placement_grad_norm(model, group)
    else:
        norm = grad_norm(model, None if mode == "baseline" else group)
    optimizer.step()
    optimizer.schedule.step()
    # After the step (AdamW creates its state in the first one), before the grads are cleared.
    sizes = state_bytes(model, optimizer) if meter is not None else None
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), norm, sizes


class _Progress:
    """One line per step on rank 0 with every mode's loss and time, rewritten in place on a
    terminal, a few lines in all otherwise."""

    def __init__(self, steps, enabled):
        self.steps, self.enabled = steps, enabled
        self.tty = sys.stdout.isatty()

    def update(self, step, last):
        if not self.enabled:
            return
        line = f"  step {step + 1:>3}/{self.steps}  " + "  ".join(
            f"{mode} {loss:.4f} {seconds * 1e3:.1f} ms" for mode, (loss, seconds) in last.items())
        if self.tty:
            print("\r" + line, end="\n" if step + 1 == self.steps else "", flush=True)
        elif (step + 1) % max(1, self.steps // 4) == 0 or step + 1 == self.steps:
            print(line, flush=True)


def interleaved_order(modes, step):
    """The order the modes run in at `step`: rotated by one each step, so that no mode always
    runs first (after a barrier wait) or always after the same other mode."""
    k = step % len(modes)
    return list(modes[k:]) + list(modes[:k])


def run_modes(modes, spec):
    """Train every mode of `modes` side by side on this rank, interleaved step by step: step k
    of each mode runs on the same batch, one after the other, in `interleaved_order`. A minute
    of load from other work on the machine then lands on every mode alike, and step k of two
    modes is a paired sample (see metrics.ratio_interval). Every rank calls it;
    the baseline runs on rank 0 alone with `spec.baseline_threads` threads.

    Returns {mode: this rank's per-step lists (loss, grad_norm, step_time_s) and memory},
    without the baseline on ranks other than 0."""
    world = dist.group.WORLD if dist.is_initialized() else None
    rank = dist.get_rank() if world is not None else 0
    mesh = mesh_2d(spec.dp, spec.tp, current_device().type) if spec.dp > 1 else None
    runs = {mode: ModeRun(mode, spec, world, rank, mesh) for mode in modes
            if mode != "baseline" or rank == 0}
    progress = _Progress(spec.steps, spec.progress and rank == 0)
    for step in range(spec.steps):
        # Every rank derives the order from the same full list, or their collectives would
        # pair one mode's step on one rank with another mode's on the next.
        for mode in interleaved_order(modes, step):
            if mode in runs:
                runs[mode].step(step)
        progress.update(step, {m: (r.out["loss"][-1], r.out["step_time_s"][-1])
                               for m, r in runs.items()})
    for run in runs.values():
        run.finish()
    return {mode: run.out for mode, run in runs.items()}


def _sent_bytes():
    """Bytes this host has sent on the network interface gloo uses (GLOO_SOCKET_IFNAME), or
    None when none is named (loopback runs). Read around each step, it gives the bytes a mode
    really puts on the wire, headers included (see profiling/wires/link.py)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if not name:
        return None
    try:
        with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class ModeRun:
    """One mode's model, optimizer and measurements on this rank. `world`: every rank (they
    start each step together); `mesh`: the 2-D grid, or None (then the world is the TP group)."""

    def __init__(self, mode, spec, world, rank, mesh=None):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
        self.mode, self.spec, self.world, self.rank = mode, spec, world, rank
        two_d = mesh is not None and mode != "baseline"
        self.group = mesh["tp"].get_group() if two_d else world
        self.dp_group = mesh["dp"].get_group() if two_d else None
        self.device = current_device()
        # The other ranks sit idle while the baseline runs: give it the whole machine.
        self.threads = spec.baseline_threads if mode == "baseline" else torch.get_num_threads()
        self.model = build_model(mode, spec.config, self.group, self.device, spec.torch_dtype,
                                 spec.seed, mesh if two_d else None, spec.check_replicated_grads,
                                 ring_pieces=spec.ring_pieces)
        self.optimizer = make_optimizer(self.model, spec.lr)
        self.corpus = _corpus(spec.seed)
        self.aligned = mode != "baseline" and world is not None
        self.out = {"rank": rank, "threads": self.threads, "loss": [], "grad_norm": [],
                    "step_time_s": []}

    def step(self, step):
        spec, device = self.spec, self.device
        ids, labels = (t.to(device) for t in data.batch(self.corpus, step, spec.batch, spec.seq,
                                                        spec.seed))
        if self.dp_group is not None:  # this DP rank's rows of the global batch
            ids, labels = split_batch(ids, self.dp_group), split_batch(labels, self.dp_group)
        meter = SavedActivationBytes(self.model) if step == 0 else None  # step 0 is warm-up
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            if device.type == "cuda":
                resident = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            if self.aligned:
                barrier(self.world)
            sent, start = _sent_bytes(), now(device)
            loss, norm, sizes = train_step(self.mode, self.model, self.optimizer, ids, labels,
                                           self.group, meter, self.dp_group)
            seconds = now(device) - start
            if sent is not None:
                self.out.setdefault("sent_bytes", []).append(_sent_bytes() - sent)
        finally:
            torch.set_num_threads(threads)
        if self.dp_group is not None:  # untimed: the whole batch's loss, for the report
            loss = all_reduce_(torch.tensor(loss, dtype=torch.float64, device=device),
                               self.dp_group).item() / dist.get_world_size(self.dp_group)
        if sizes is not None:
            self.out["memory"] = {**sizes, "saved_activation_bytes": meter.bytes,
                                  "saved_activation_storages": meter.count}
        if device.type == "cuda":
            # The other modes' models live on the same device: count this mode's own resident
            # state (parameters, optimizer state; the gradients were freed) plus what its
            # step allocated on top of everything resident.
            mem = self.out["memory"]
            own = mem["param_bytes"] + mem["optimizer_bytes"]
            peak = own + torch.cuda.max_memory_allocated(device) - resident
            mem["cuda_max_allocated_bytes"] = max(mem.get("cuda_max_allocated_bytes", 0), peak)
        self.out["loss"].append(loss)
        self.out["grad_norm"].append(norm)
        self.out["step_time_s"].append(seconds)

    def finish(self):
        if self.spec.trace_dir and self.mode != "baseline":
            _export_trace(self.mode, self.model, self.optimizer, self.corpus, self.spec,
                          self.group, self.rank, self.device, self.dp_group)


def _export_trace(mode, model, optimizer, corpus, spec, group, rank, device, dp_group=None):
    """One extra step under torch.profiler, saved as a Chrome trace (opens in Perfetto)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    ids, labels = (t.to(device) for t in data.batch(corpus, spec.steps, spec.batch, spec.seq,
                                                    spec.seed))
    if dp_group is not None:
        ids, labels = split_batch(ids, dp_group), split_batch(labels, dp_group)
    with profile(activities=activities) as prof:
        train_step(mode, model, optimizer, ids, labels, group, dp_group=dp_group)
    with atomic_path(os.path.join(spec.trace_dir, f"trace_{mode}_rank{rank}.json")) as tmp:
        prof.export_chrome_trace(tmp)
