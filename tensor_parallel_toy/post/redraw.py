"""The posts' measured figures, redrawn from the committed results without measuring again.

    python -m tensor_parallel_toy.post.redraw blog

draws every PNG the posts show from a results file beside it, with the profile's own plotting
code (`profiling/report/plots.py`): the default run's in `blog/results/`, and the emulated link's
sweep and block timeline in `blog/link/`. Use it after changing how a figure is drawn; a new
measurement (`bash run_profile.sh --out blog/results`) draws them itself.
"""
import json
import os
import sys

from ..profiling.report import plots, report


def _load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def redraw_run(folder):
    """The figures of one profile run, from its results.json. Returns the paths written."""
    results = _load(os.path.join(folder, "results.json"))
    modes, network = results["modes"], report.link_label(results["meta"])
    out = lambda name: os.path.join(folder, name)  # noqa: E731
    plots.plot_losses(modes, out("loss.png"))
    plots.plot_grad_norms(modes, out("grad_norm.png"))
    plots.plot_step_times(modes, out("step_time.png"), network)
    plots.plot_memory(modes, out("memory.png"), results.get("memory_tp_no_sp"))
    written = [out(n) for n in ("loss.png", "grad_norm.png", "step_time.png", "memory.png")]
    if "overlap_benchmark" in results:
        plots.plot_overlap(results["overlap_benchmark"], out("overlap.png"), network)
        written.append(out("overlap.png"))
    if "timeline" in results:
        plots.plot_timeline(results["timeline"]["spans"], out("timeline.png"), "", network,
                            results["timeline"]["summary"])
        written.append(out("timeline.png"))
    return written


def redraw_link(folder):
    """The link figures the post shows: the sweep, and the timeline of the 1 Gbit/s run."""
    sweep = _load(os.path.join(folder, "sweep.json"))
    plots.plot_sweep(sweep, os.path.join(folder, "sweep.png"))
    link = _load(os.path.join(folder, "results_1gbit.json"))
    timeline = os.path.join(folder, "timeline_1gbit.png")
    plots.plot_timeline(link["timeline"]["spans"], timeline, "", report.link_label(link["meta"]),
                        link["timeline"]["summary"])
    return [os.path.join(folder, "sweep.png"), timeline]


def redraw_all(blog_dir):
    return redraw_run(os.path.join(blog_dir, "results")) + redraw_link(
        os.path.join(blog_dir, "link"))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python -m tensor_parallel_toy.post.redraw BLOG_DIR (the folder that "
                 "holds results/ and link/)")
    for path in redraw_all(sys.argv[1]):
        print(f"wrote {path}")
