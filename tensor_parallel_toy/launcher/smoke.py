"""`python -m tensor_parallel_toy.launcher.smoke`: can two ranks talk at all? gpu-check's first
step.

Two local ranks form a process group (NCCL on CUDA, gloo on CPU) exactly as the suite's worker
pools do, then run one all-reduce, one step of the package's ring (a `batch_isend_irecv` pair,
what the overlapped layers post) and a barrier, checking each result. Within `--timeout`
seconds (plus the ranks' start) it prints one line saying what worked, or one line
`FAILED smoke: <cause>` with the failing rank's own error (the exception's first line, and its
last where NCCL names the failed CUDA call there), a rank's death (an abort named as such) or
the ranks that never answered, and exits with status 1. Every later step starts its ranks the
same way, so gpu-check stops at a failed smoke step instead of letting each test wait out its
own time limit.
"""
import argparse
import sys
import time

PROG = "python -m tensor_parallel_toy.launcher.smoke"
DEFAULT_TIMEOUT_S = 60.0


def _on_rank():
    import torch
    import torch.distributed as dist

    from ..guards.collectives import barrier
    from ..ring import Ring
    from .initialize import current_device

    group, device = dist.group.WORLD, current_device()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    x = torch.full((1 << 12,), float(rank + 1), device=device)
    dist.all_reduce(x, group=group)
    total = size * (size + 1) / 2
    if not bool((x == total).all()):
        raise AssertionError(f"all-reduce gave {x[0].item()} on rank {rank}, expected {total}")
    ring = Ring(group)
    send = torch.full((1 << 12,), float(rank), device=device)
    recv = torch.full_like(send, -1.0)
    ring.shift(send, recv).wait()
    if not bool((recv == ring.prev).all()):
        raise AssertionError(f"ring step: rank {rank} received {recv[0].item()}, expected "
                             f"{ring.prev} from rank {ring.prev}")
    barrier(group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return str(device)


def run(device, timeout_s=DEFAULT_TIMEOUT_S):
    """(passed, one line): the smoke test on two ranks of `device` ("cuda": NCCL, "cpu": gloo)."""
    from .pool import WorkerError, WorkerPool

    backend = "nccl" if device == "cuda" else "gloo"
    start = time.perf_counter()
    try:
        with WorkerPool(2, backend=backend, timeout_s=timeout_s,
                        start_timeout_s=timeout_s + 30) as pool:
            formed = time.perf_counter() - start
            devices = pool.run(_on_rank, timeout_s=timeout_s)
    except (WorkerError, ValueError) as e:
        # NCCL picks its transport (shared memory, P2P over NVLink or PCIe, NVLS) by itself:
        # these switch each off in turn to find the one that fails (NCCL's environment docs).
        hint = ("; to narrow it down, run again with NCCL_DEBUG=INFO, then with one of "
                "NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1, NCCL_NVLS_ENABLE=0"
                if backend == "nccl" else "")
        return False, f"FAILED smoke: {str(e).splitlines()[0]}{hint}"
    return True, (f"smoke: passed: 2 ranks formed a {backend} group in {formed:.1f} s on "
                  f"{', '.join(devices)}; all-reduce, ring step and barrier correct")


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: NCCL ranks (the check); cpu: gloo ranks (a rehearsal)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds the group's forming and each collective may take (default "
                        f"{DEFAULT_TIMEOUT_S:g}; the ranks' start gets 30 more)")
    args = p.parse_args(argv)
    if not args.timeout > 0:
        p.error(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    import torch

    from .initialize import nccl_version
    version = ".".join(map(str, nccl_version() or ())) or "none"
    print(f"smoke: 2 {'NCCL' if args.device == 'cuda' else 'gloo'} ranks on {args.device}; "
          f"torch {torch.__version__}, NCCL {version}", flush=True)
    passed, line = run(args.device, args.timeout)
    print(line, flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
