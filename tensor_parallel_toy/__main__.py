"""Command line: `python -m tensor_parallel_toy test [pytest args...]`,
`python -m tensor_parallel_toy profile [flags]` (see `profile --help`),
`python -m tensor_parallel_toy gpu-check [flags]` (everything claimed about GPUs, run on this
machine's; see `gpu-check --help`) and `python -m tensor_parallel_toy blog` (the posts' figures
and text, from the committed results)."""
import argparse
import os
import sys


def _test(extra_args):
    import pytest

    from .launcher.initialize import (SHARE_GPU_ENV, gpu_count, nccl_rank_capacity,
                                      share_gpu_route)

    gpus = gpu_count()
    shared = nccl_rank_capacity() > gpus
    print("tensor_parallel_toy test: ranks are CPU processes over gloo"
          + (f"; the NCCL tests also run, their ranks sharing 1 GPU {share_gpu_route()} "
             f"({SHARE_GPU_ENV}=1: a correctness run, its speed means nothing)" if shared else
             f"; the NCCL tests also run, on {gpus} GPUs" if gpus >= 2 else
             f"; NCCL tests skipped ({gpus} CUDA GPUs, they need >= 2)"), flush=True)
    tests_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests")
    # Test files named on the command line replace the default: the whole suite.
    targets = [] if path_arguments(extra_args) else [tests_dir]
    # -rfEs: the short summary lists failures, errors and skips (-rs alone would drop pytest's
    # default -rfE, and with it the FAILED lines). Plugins the suite does not use, where
    # installed, are left out: each one slows every start (gpu-check starts the suite twice).
    code = pytest.main([*targets, "-q", "-rfEs", "-p", "no:cacheprovider", "-p", "no:benchmark",
                        "-p", "no:hypothesispytest", *extra_args])
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("error: no tests were collected: a test run that tests nothing is a failure",
              file=sys.stderr)
        return 1
    return int(code)


# pytest options whose value is the next argument: `-k nccl` names tests, not a folder `nccl`.
_TAKES_A_VALUE = {"-k", "-m", "-p", "-o", "-c", "-W", "--deselect", "--ignore", "--ignore-glob",
                  "--rootdir", "--junitxml", "--junit-xml", "--maxfail", "--durations",
                  "--basetemp", "--confcutdir", "--override-ini", "--tb", "-r"}


def path_arguments(args):
    """The arguments that name test files or folders (not an option's value)."""
    return [a for i, a in enumerate(args) if not a.startswith("-")
            and (i == 0 or args[i - 1] not in _TAKES_A_VALUE)
            and os.path.exists(a.split("::")[0])]


def _blog():
    """Draw the conceptual figures into blog/figures and render blog/src/*.md into blog/."""
    from .post import concepts, render

    blog_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "blog")
    try:
        written = concepts.draw_all(os.path.join(blog_dir, "figures"))
        written += render.write_posts(blog_dir)
    except (KeyError, ValueError) as e:  # a placeholder the results cannot fill
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {os.path.relpath(path, os.path.dirname(blog_dir))}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tensor_parallel_toy",
        description="Tensor + sequence parallelism with hand-written autograd.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("test", help="run the test suite (spawns its own worker ranks); "
                                "extra arguments go to pytest")
    sub.add_parser("profile", add_help=False,
                   help="train baseline / tp / tp_overlap / dtensor side by side and measure "
                        "them; `profile --help` lists the flags")
    sub.add_parser("gpu-check", add_help=False,
                   help="run a two-rank NCCL smoke test, the NCCL tests, the CUDA stream "
                        "sanitizer, a profile and a large-shape overlap benchmark on this "
                        "machine's GPUs (--rehearse: the same steps on CPU); `gpu-check --help` "
                        "lists the flags")
    sub.add_parser("blog", help="redraw the posts' conceptual figures and render blog/src/*.md "
                                "with the numbers of the committed profile runs")
    args, extra = parser.parse_known_args(argv)
    if args.command == "test":
        return _test(extra)
    if args.command == "profile":
        from .profiling.cli import main as profile_main
        return profile_main(extra)
    if args.command == "gpu-check":
        from .launcher.gpu_check import main as gpu_check_main
        return gpu_check_main(extra)
    if args.command == "blog":
        if extra:
            parser.error(f"blog takes no arguments, got {' '.join(extra)}")
        return _blog()
    parser.error(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
