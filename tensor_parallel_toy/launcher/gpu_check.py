"""`python -m tensor_parallel_toy gpu-check`: everything this package claims about GPUs, run on
the GPUs of this machine, in one command.

Steps, each its own process, in order:
1. nccl-tests: the suite's NCCL variants (the layers on multi-MB transfers, strided inputs,
   subgroups, bf16, the whole model, the profile's phases with every collective checked for
   its device); `pytest -k nccl`.
2. sanitizer: the overlapped layers' NCCL tests again under TORCH_CUDA_SANITIZER=1, PyTorch's
   CUDA stream sanitizer, which reports a kernel that reads a tensor another stream may still
   be writing (https://pytorch.org/docs/stable/cuda._sanitizer.html).
3. profile: a short default profile on NCCL (every phase, all modes).
4. large-overlap: the overlap benchmark at a shape where GEMMs and transfers take milliseconds
   (s=8192, b=1, h=4096, m=16384, bf16), with tp and tp_overlap trained beside it: the numbers
   a post about GPUs would quote.

With one GPU, `--share-gpu` runs two ranks on it (TENSOR_PARALLEL_TOY_SHARE_GPU=1: each rank
claims its own NCCL host id; see initialize.share_gpu_env): the NCCL code path for real, but
the ranks share one GPU's SMs and talk through sockets, so steps 1-3 check correctness only and
step 4 is skipped. Without a GPU it says so in one line and exits with status 2.
"""
import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
import time

PROG = "python -m tensor_parallel_toy gpu-check"
LARGE_SHAPE = "8192,1,4096,16384"  # s, b, h, m: 64 MiB of bf16 activations per rank and step


@dataclasses.dataclass
class Step:
    name: str
    argv: list
    env: dict
    what: str
    results: str = None  # the folder it writes, if any


def plan(gpus, share_gpu, out, python=sys.executable):
    """The steps for a machine with `gpus` GPUs (see the module docstring), writing under `out`.
    Raises ValueError (one line) where the machine cannot run them."""
    if gpus == 0:
        raise ValueError("no CUDA GPU here: nothing to check (run it on a machine with NVIDIA "
                         "GPUs; the CPU suite is `bash run_tests.sh`)")
    if gpus == 1 and not share_gpu:
        raise ValueError("1 CUDA GPU: the NCCL tests need 2 ranks; add --share-gpu to run two "
                         "ranks on this one GPU (a correctness run: its speed means nothing)")
    env = {"TENSOR_PARALLEL_TOY_SHARE_GPU": "1"} if gpus == 1 else {}
    package = [python, "-m", "tensor_parallel_toy"]
    steps = [
        Step("nccl-tests", [*package, "test", "-k", "nccl"], env,
             "the suite's NCCL variants"),
        Step("sanitizer", [*package, "test", "-k", "nccl and overlap"],
             {**env, "TORCH_CUDA_SANITIZER": "1"},
             "the overlapped layers' NCCL tests under the CUDA stream sanitizer"),
        Step("profile", [*package, "profile", "--device", "cuda", "--steps", "20",
                         "--out", os.path.join(out, "profile")], env,
             "a short profile on NCCL, every phase", os.path.join(out, "profile")),
    ]
    if gpus >= 2:
        steps.append(Step(
            "large-overlap",
            [*package, "profile", "--device", "cuda", "--dtype", "bf16", "--modes",
             "tp,tp_overlap", "--steps", "30", "--bench-iters", "30", "--bench-shape",
             LARGE_SHAPE, "--timeline-iters", "11", "--out", out], env,
            f"the overlap benchmark at s,b,h,m = {LARGE_SHAPE}, bf16", out))
    return steps


def _parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join("results", "gpu"),
                   help="folder for the profiles' results (default results/gpu; "
                        "blog/gpu to commit them beside the post)")
    p.add_argument("--share-gpu", action="store_true",
                   help="with one GPU: run two ranks on it (correctness only)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the steps' commands and stop (works without a GPU)")
    return p


def main(argv=None, gpus=None):
    args = _parser().parse_args(argv)
    if gpus is None:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        steps = plan(max(gpus, 2) if args.dry_run and gpus == 0 else gpus, args.share_gpu,
                     args.out)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for step in steps:
            env = " ".join(f"{k}={v}" for k, v in step.env.items())
            print(f"{step.name}: {env + ' ' if env else ''}{shlex.join(step.argv)}")
        return 0
    print(f"{PROG}: {gpus} GPU(s)" + (", two ranks sharing one (correctness only)"
                                       if gpus == 1 else ""), flush=True)
    outcome = []
    for step in steps:
        print(f"\n=== {step.name}: {step.what}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(step.argv, env={**os.environ, **step.env})
        outcome.append((step, code, time.perf_counter() - start))
    print(f"\n{PROG}: summary")
    for step, code, seconds in outcome:
        where = f", results in {step.results}/" if step.results and code == 0 else ""
        print(f"  {'passed' if code == 0 else f'FAILED (exit {code})':<16} {step.name} "
              f"({seconds:.0f} s){where}")
    if gpus == 1:
        print("  skipped          large-overlap (two ranks on one GPU: timings mean nothing)")
    return 0 if all(code == 0 for _, code, _ in outcome) else 1
