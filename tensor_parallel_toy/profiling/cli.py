"""`python -m tensor_parallel_toy profile`: train baseline / tp / tp_overlap / dtensor side by
side, benchmark the overlap op by op, record a timeline, and write it all to a results folder.

Every flag is checked before any process starts (flags.py): a bad value is one line on stderr
and exit status 2. Here, how the ranks run. Locally the ranks are a `WorkerPool` spawned once for every phase, and SIGTERM or
SIGINT stops them with the run at any moment (exit status 128 + the signal, the results folder
as it was: launcher/signals.py); under `torchrun` each rank runs the same phases
(run/phases.py) and rank 0 gathers the numbers and writes the files. With
`--link RATE` (Linux, root) each rank runs that torchrun path in its own network namespace
behind a shaped link (wires/link.py); several rates make a sweep over them
(wires/link_sweep.py).

    results/results.json   every number, the config, versions, device, backend, world size
    results/summary.txt    the table printed at the end, with the targets
    results/loss.png, grad_norm.png, step_time.png, memory.png, overlap.png, timeline.png
    results/trace_<mode>_rank<r>.json   with --trace: torch.profiler Chrome traces (Perfetto)
"""
import os
import signal
import sys
import time

from ..launcher.initialize import LaunchError, init_from_env, shutdown
from ..launcher.pool import WorkerPool
from ..launcher.signals import Stopped, stop_on_signals
from .flags import PROG, UsageError, parse_args
from .report import report
from .run.phases import PoolRunner, TorchrunRunner, run_phases, under_torchrun, write_outputs
from .wires import link, link_sweep, wire_sweep


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    args.argv = argv
    if args.link is not None:
        return _run_on_link(args, argv)
    sweep = args.wire_rates and len(args.wire_rates) > 1  # several modeled rates: the op sweep
    if under_torchrun(os.environ) and not sweep:
        return _run_under_torchrun(args)
    # This process owns the ranks: a signal must stop them with it, not leave them running.
    try:
        with stop_on_signals(signal.SIGTERM, signal.SIGINT):
            return wire_sweep.run(args) if sweep else _run_on_a_pool(args)
    except Stopped as e:
        print(f"{PROG}: {e}; its ranks are stopped", file=sys.stderr)
        return e.code


def _run_on_a_pool(args):
    start = time.perf_counter()
    ranks = args.tp * args.dp
    print(f"spawning {ranks} ranks ({args.backend})...", flush=True)
    with WorkerPool(ranks, backend=args.backend,
                    high_priority_streams=args.nccl_high_priority) as pool:
        results = run_phases(PoolRunner(pool, args.timeout), args)
    _write_and_print(results, args.out, start)
    return 0


def _run_under_torchrun(args):
    start = time.perf_counter()
    try:  # the first collective: where a wrong address or network interface shows
        init_from_env(args.backend, timeout_s=args.timeout,
                      high_priority_streams=args.nccl_high_priority)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        runner = TorchrunRunner()
        results = run_phases(runner, args)
    finally:
        shutdown()
    if runner.rank == 0:
        _write_and_print(results, args.out, start)
    _leave_torchrun_rank(0)


def _write_and_print(results, out, start):
    results["meta"]["runtime_s"] = time.perf_counter() - start
    summary = write_outputs(results, out)
    print("\n" + summary, end="")
    print(f"wrote {', '.join(results['files'])} to {out}/ "
          f"in {results['meta']['runtime_s']:.0f} s")


def _leave_torchrun_rank(code):
    """End a torchrun rank whose group is shut down, skipping the interpreter's teardown: with
    torch 2.13 on gloo, a rank sometimes aborted there ("terminate called without an active
    exception", SIGABRT, no Python frame left), measured in about half of the suite's runs
    on 2 busy cores, and torchrun then killed its peer mid-report. Nothing is left to clean:
    the outputs are written and the group destroyed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_on_link(args, argv):
    """One rank per network namespace, each the torchrun path of this same command."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.tp)
    command = [sys.executable, "-m", "tensor_parallel_toy", "profile",
               *link.argv_for_ranks(argv, threads)]

    def run():
        link.check_host()
        if len(args.link_rates) > 1:
            return link_sweep.run(argv, args, threads)
        (bps, rate), = args.link_rates
        with link.EmulatedLink(args.tp, bps, rate) as net:
            print(report.link_text(net.describe()), flush=True)
            net.run_ranks(command)
    return link.exit_status(PROG, run)
