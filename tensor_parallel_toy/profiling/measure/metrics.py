"""What the profile measures on each rank: memory, synchronized timing, and their summaries.

Memory on CPU has no allocator statistics, so we count what a training step must hold:
- activations: every tensor autograd saves for backward, seen through
  `torch.autograd.graph.saved_tensors_hooks`, counted once per storage (a view and its base,
  or a tensor saved by two ops, are one allocation) and excluding the parameters themselves;
- parameters, gradients and optimizer state: the bytes of this rank's local tensors.
On CUDA we report the allocator's `max_memory_allocated` as well.

Every rank measures with the memory it frees kept for its next allocations
(`keep_freed_memory`), as PyTorch's CUDA caching allocator keeps it.
"""
import ctypes
import statistics
import time

import numpy as np
import torch

MiB = 2 ** 20  # the unit every memory and traffic figure is reported in


def local_tensor(t):
    """The tensor this rank actually stores: a DTensor's local shard, the result inside an
    in-flight collective's wrapper (`AsyncCollectiveTensor.elem`), else `t` itself."""
    while True:
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        elif type(t).__name__ == "AsyncCollectiveTensor":
            t = t.elem  # not .wait(): measuring must not add a synchronization
        else:
            return t


def _storage_key(t):
    t = local_tensor(t)
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _is_parameter(t):
    """A Parameter or a view of one (a transposed weight). FSDP2 swaps in the unsharded
    Parameters for the forward and frees their storage after it, so they are not among the
    model's parameters when the meter starts, yet they are no activations."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class SavedActivationBytes:
    """Context manager: bytes of the tensors saved for backward inside it, deduplicated by
    storage, parameters excluded. Read `.bytes` (total), `.count` (storages) and
    `.storage_bytes` (each storage's bytes) afterwards."""

    def __init__(self, model):
        # Held, not only keyed: a parameter replaced inside the block (as FSDP2 does) must not
        # free its storage for an activation to reuse, which would then be taken for it.
        self._held = list(model.parameters())
        self._params = {_storage_key(p) for p in self._held}
        self._seen = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        key = _storage_key(tensor)
        if key not in self._params and key not in self._seen and not _is_parameter(tensor):
            self._seen[key] = local_tensor(tensor).untyped_storage().nbytes()
        return tensor  # keep the tensor itself: measuring must not change what is stored

    @staticmethod
    def _unpack(tensor):
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self._seen.values())

    @property
    def count(self):
        return len(self._seen)

    @property
    def storage_bytes(self):
        """The bytes of each storage counted, largest first."""
        return sorted(self._seen.values(), reverse=True)


def _nbytes(tensors):
    total = 0
    for t in tensors:
        if t is not None:
            t = local_tensor(t)
            total += t.numel() * t.element_size()
    return total


def state_bytes(model, optimizer):
    """This rank's parameter, gradient and optimizer-state bytes (call before zero_grad)."""
    params = list(model.parameters())
    opt_tensors = [v for state in optimizer.state.values() for v in state.values()
                   if torch.is_tensor(v)]
    return {"param_bytes": _nbytes(params), "grad_bytes": _nbytes(p.grad for p in params),
            "optimizer_bytes": _nbytes(opt_tensors)}


def synchronize(device):
    """Wait for the device: a CUDA step has not finished when the host gets past it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device):
    synchronize(device)
    return time.perf_counter()


def stamp(device):
    """Now, on `device`'s clock: the host's `perf_counter` on CPU; on CUDA an event queued on
    the device's current stream, which records when the GPU gets there."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class DeviceTimer:
    """`with DeviceTimer(device) as t: ...`, then `t.seconds`: how long the work inside took.

    CPU: host time (the work is done when the calls return). CUDA: the time between two events
    queued on `device`'s current stream before and after, i.e. what the GPU did, not how long
    the host took to queue it; reading `seconds` waits for the second event."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        self.start = stamp(self.device)
        return self

    def __exit__(self, *exc):
        self.end = stamp(self.device)

    @property
    def seconds(self):
        if self.device.type != "cuda":
            return self.end - self.start
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def summarize(values):
    """Median and spread of a list of timings (seconds)."""
    values = sorted(values)
    if not values:
        return {}

    def pct(q):  # linear interpolation between the closest ranks
        pos = q * (len(values) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(values) - 1)
        return values[lo] + (values[hi] - values[lo]) * (pos - lo)

    return {"median": statistics.median(values), "p10": pct(0.1), "p25": pct(0.25),
            "p75": pct(0.75), "p90": pct(0.9), "min": values[0], "max": values[-1],
            "n": len(values)}


def ratio_interval(numerator, denominator, resamples=2000, seed=0):
    """median(numerator) / median(denominator) and its bootstrap 95 % interval.

    The two lists are paired: element i of each was measured in the same interleaved step
    (train.run_modes), so a resample draws step indices and keeps the pairs together, and load
    that hit step i hits both sides of the ratio. Percentile bootstrap (Efron & Tibshirani,
    "An Introduction to the Bootstrap", 1993, ch. 13), seeded: the same timings always give the
    same interval.
    """
    return paired_interval(_median_ratio, [numerator, denominator], resamples, seed)


def _median_ratio(a, b):
    return np.median(a, axis=-1) / np.median(b, axis=-1)


def paired_interval(statistic, lists, resamples=2000, seed=0):
    """`statistic(*lists)` and its bootstrap 95 % interval, as `ratio_interval` (which is this
    with the ratio of medians): element i of every list was measured in the same interleaved
    step, and a resample draws step indices for all of them at once. `statistic` takes arrays
    whose last axis is the steps (`np.median(a, axis=-1)`, ...)."""
    arrays = [np.asarray(values, dtype=float) for values in lists]
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1 or min(lengths) < 2:
        raise ValueError(f"need paired lists of at least 2 timings each, got lengths "
                         f"{', '.join(str(len(a)) for a in arrays)}")
    n = lengths.pop()
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    values = statistic(*(a[idx] for a in arrays))
    low, high = np.percentile(values, [2.5, 97.5])
    return {"ratio": float(statistic(*arrays)), "ci95": [float(low), float(high)], "n": n,
            "resamples": resamples}


def keep_freed_memory():
    """Make this process keep the memory it frees for its next allocations, as PyTorch's CUDA
    caching allocator does on a GPU (glibc's mallopt: no mmap below 1 GiB, no trimming).

    PyTorch's CPU allocator hands large blocks back to the kernel, and the next block of that
    size comes back as fresh pages that the kernel zeroes on first touch: measured here, a
    column layer's 14 MB output cost 3,500 page faults, about 5 ms, half its GEMM, in some
    steps and not others. Every mode of a profile run gets the same setting. Elsewhere than
    glibc it does nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
