"""What `guard(model)` costs, measured.

`python -m tensor_parallel_toy.profiling.measure.guard_cost`: the profile's default model at TP
2 on local CPU ranks (gloo), trained the same way twice, interleaved step by step so that the
machine's drift hits both alike: once guarded with the per-step checks only (the batch compared
over the group, ids in range), once bare. Printed: each one-time cost (the ranks comparing what
they built; the replicated gradients compared at the first backward) and the per-step cost, as
the median of the per-step differences with their interquartile range, beside the median step,
and the checks timed alone, on the slowest rank.
"""
import argparse
import statistics
import time

import torch

from ...guards import guard
from ...guards.batch import check_batch
from ...guards.collectives import barrier, reduce_numbers
from ...guards.replicated_grads import check_replicated_gradients
from ...launcher.pool import launch
from ...model import Transformer
from ..spec import ProfileSpec


def _step(model, ids, labels):
    loss = model(ids, labels)
    loss.backward()
    for p in model.parameters():
        p.grad = None


def _on_rank(steps, warmup):
    import torch.distributed as dist

    group, spec = dist.group.WORLD, ProfileSpec()
    torch.manual_seed(0)
    ids = torch.randint(0, spec.config.vocab_size, (spec.batch, spec.seq))
    labels = ids.roll(-1, 1)
    bare = Transformer(spec.config, tp_group=group)
    guarded = Transformer(spec.config, tp_group=group)
    barrier(group)
    start = time.perf_counter()
    guard(guarded, check_replicated_grads=None)  # the per-step checks only, timed below
    build = time.perf_counter() - start
    _step(bare, ids, labels)
    bare(ids, labels).backward()
    barrier(group)
    start = time.perf_counter()
    check_replicated_gradients(bare, group)  # what "first" runs once, at the first backward
    grads_check = time.perf_counter() - start
    times = {"bare": [], "guarded": []}
    for i in range(warmup + steps):
        for name, model in (("bare", bare), ("guarded", guarded)) if i % 2 else \
                (("guarded", guarded), ("bare", bare)):
            barrier(group)
            start = time.perf_counter()
            _step(model, ids, labels)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    alone = []  # the per-step checks by themselves: what the hook runs before the forward
    for _ in range(steps):
        barrier(group)
        start = time.perf_counter()
        check_batch(guarded, group, ids, labels)
        alone.append(time.perf_counter() - start)
    diffs = [g - b for g, b in zip(times["guarded"], times["bare"])]
    q1, median, q3 = statistics.quantiles(diffs, n=4)
    numbers = [build, grads_check, median, q1, q3, statistics.median(times["bare"]),
               statistics.median(alone)]
    return reduce_numbers(numbers, group, dist.ReduceOp.MAX)  # the slowest rank's


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tensor_parallel_toy.profiling.measure.guard_cost",
        description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    args = parser.parse_args(argv)
    if args.steps < 4 or args.warmup < 1:
        parser.error(f"--steps {args.steps} --warmup {args.warmup}: need steps >= 4, warmup >= 1")
    build, grads_check, step, q1, q3, bare, alone = launch(_on_rank, 2, args.steps,
                                                           args.warmup)[0]
    ms = 1e3
    print(f"model: ProfileSpec's default, TP 2, gloo on this machine's CPUs; step (bare) "
          f"{bare * ms:.1f} ms")
    print(f"once, at guard():            ranks compare the model   {build * ms:.2f} ms")
    print(f"once, at the first backward: replicated gradients      {grads_check * ms:.2f} ms")
    print(f"every step: batch compared, ids in range  {step * ms:+.2f} ms "
          f"[IQR {q1 * ms:+.2f} .. {q3 * ms:+.2f}] = {step / bare:+.1%} of a step")
    print(f"every step, the checks alone (median of {args.steps} calls): {alone * ms:.2f} ms "
          f"= {alone / bare:.1%} of a step")


if __name__ == "__main__":
    main()
