"""The profile reports distributions, not single recordings: the overlap benchmark's ratios
per block of rounds, the timeline over all its recordings; and its plots draw them.

The summaries are fed made-up per-rank numbers whose answer is known (so a ratio of medians
or a single round passed off as a block's, or the faster rank taken for the slower, fails
here); the plots are fed small synthetic results.
"""
import json
import os
import re

import pytest

from tensor_parallel_toy.profiling.measure import bench_overlap, timeline
from tensor_parallel_toy.profiling.report import plots, report, targets

KEYS = ("median", "p10", "p90", "min", "max", "n", "values")


def _bench_rank(times, slow=1.0):
    """One rank's raw benchmark numbers: `times` {variant: [seconds per round]}, scaled."""
    rounds = len(times["comm"])
    raw = {"times": {v: [t * slow for t in ts] for v, ts in times.items()},
           "comm_cpu": [1e-4] * rounds, "comm_cpu_main": [1e-5] * rounds,
           "seq_comm": [1e-3] * rounds,
           "phases": [{"comm": [1e-3] * 3, "gemm": [2e-3] * 3}]}
    return {"shape": {"s": 8, "b": 2, "h": 16, "f": 32, "p": 2, "calibrated": False,
                      "dtype": "fp32"},
            "raw": {name: raw for name in bench_overlap.OPS}, "device": "cpu"}


def test_overlap_ratios_are_per_block_of_rounds_from_the_slowest_rank():
    """Three blocks of 5 rounds. Each block's ratio is median(T_overlap) / max(median(T_comm),
    median(T_gemm)) over its own rounds, on the slowest rank's times: 1.5, 1.2 and 1.3. The
    first block holds one very slow and one impossibly fast round (ratios 9 and 0.1): its
    median ignores them, and no block's ratio is theirs."""
    k = bench_overlap.ROUNDS_PER_BLOCK
    assert k == 5, "the rounds below are laid out in blocks of 5"
    comm = [0.2] * 15
    gemm = [1.0] * 5 + [2.0] * 5 + [1.0] * 5
    overlap = [1.5, 1.5, 9.0, 1.5, 0.1] + [2.4] * 5 + [1.3] * 5
    basic = [2.0] * 5 + [4.0] * 5 + [2.0] * 5  # 2.0 in every block
    seq = [1.3] * 15
    times = {"comm": comm, "gemm": gemm, "seq": seq, "overlap": overlap, "basic": basic}
    slower = _bench_rank(times)
    faster = _bench_rank(times, slow=0.5)  # every time half: the summary must take the other
    out = bench_overlap.summarize([faster, slower])
    for name in bench_overlap.OPS:
        row = out["ops"][name]
        got = row["overlap_over_max_blocks"]
        assert set(KEYS) <= set(got) and got["rounds_per_block"] == k, sorted(got)
        assert got["values"] == pytest.approx([1.5, 1.2, 1.3]), got["values"]
        assert (got["n"], got["median"], got["min"], got["max"]) == \
            (3, pytest.approx(1.3), pytest.approx(1.2), pytest.approx(1.5)), got
        assert got["p10"] <= got["median"] <= got["p90"], got
        basic_got = row["basic_over_max_blocks"]
        assert basic_got["values"] == pytest.approx([2.0] * 3), basic_got
        # The ratio of the medians over all 15 rounds, still reported: 1.5 / max(0.2, 1.0).
        assert row["overlap_over_max"] == pytest.approx(1.5), row["overlap_over_max"]


def _spans(total, blocked, posting):
    """A recording of one rank: one GEMM, one post, one wait of `blocked` ms, ending at
    `total`."""
    return [{"row": "compute", "kind": "gemm", "name": "mm", "start": 0.0, "end": 1.0},
            {"row": "compute", "kind": "post", "name": "post", "start": 1.0,
             "end": 1.0 + posting},
            {"row": "compute", "kind": "wait", "name": "wait", "start": 2.0,
             "end": 2.0 + blocked},
            {"row": "comm", "kind": "ring", "name": "send/recv", "start": 1.0,
             "end": 2.0 + blocked, "bytes": 64},
            {"row": "marker", "kind": "forward_end", "name": "forward end", "start": 1.5,
             "end": 1.5},
            {"row": "marker", "kind": "end", "name": "end", "start": total, "end": total}]


def _timeline_ranks():
    """Two ranks, three recordings per mode; rank 1 is the slower in recording 0 only."""
    per_rank = []
    for rank in range(2):
        modes = {}
        for mode, scale in (("tp", 1.0), ("tp_overlap", 0.8)):
            recs = [_spans(10 * scale + (3 if rank == 1 and i == 0 else 0),
                           4 * scale + i, 0.5 + 0.1 * rank) for i in range(3)]
            modes[mode] = {"spans": recs[1],  # the median one is the one kept
                           "recordings": [timeline.span_totals(r) for r in recs]}
        per_rank.append(modes)
    return per_rank


def test_timeline_distribution_is_over_recordings_slowest_rank_of_each():
    summary = timeline.summarize(_timeline_ranks())
    for mode, scale in (("tp", 1.0), ("tp_overlap", 0.8)):
        over = summary[mode]["over_recordings"]
        assert set(over) == set(timeline.DISTRIBUTED), sorted(over)
        for key, dist in over.items():
            assert set(KEYS) <= set(dist) and dist["n"] == 3 == len(dist["values"]), dist
            assert dist["min"] <= dist["p10"] <= dist["median"] <= dist["p90"] <= dist["max"], \
                (mode, key, dist)
        assert over["total_ms"]["values"] == pytest.approx([10 * scale + 3, 10 * scale,
                                                            10 * scale]), over["total_ms"]
        assert over["blocked_in_comm_ms"]["values"] == pytest.approx(
            [4 * scale, 4 * scale + 1, 4 * scale + 2]), over["blocked_in_comm_ms"]
        assert over["posting_ms"]["median"] == pytest.approx(0.6), over["posting_ms"]
        # The drawn recording's own numbers, per rank, as before.
        assert summary[mode]["total_ms"] == pytest.approx(10 * scale), summary[mode]
        assert [r["blocked_in_comm_ms"] for r in summary[mode]["per_rank"]] == \
            pytest.approx([4 * scale + 1] * 2), summary[mode]["per_rank"]


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def _dist(values):
    values = sorted(values)
    return {"median": values[len(values) // 2], "p10": values[0], "p90": values[-1],
            "min": values[0], "max": values[-1], "n": len(values), "values": values}


def test_plots_draw_the_distributions_and_the_tp_no_sp_bar_from_synthetic_results(tmp_path):
    row = {"label": "AG+GEMM, column forward", "t_comm_ms": 1.0, "t_gemm_ms": 2.0,
           "overlap_over_max_blocks": {**_dist([1.1, 1.2, 1.4]), "rounds_per_block": 5},
           "basic_over_max_blocks": {**_dist([1.5, 1.6, 1.9]), "rounds_per_block": 5}}
    bench = {"shape": {"s": 8, "b": 2, "h": 16, "f": 32, "p": 2},
             "ops": {"column_fwd": row, "row_fwd": {**row, "label": "GEMM+RS, row forward"}}}
    plots.plot_overlap(bench, str(tmp_path / "overlap.png"), "loopback")

    per_rank = _timeline_ranks()
    spans = {mode: [r[mode]["spans"] for r in per_rank] for mode in per_rank[0]}
    plots.plot_timeline(spans, str(tmp_path / "timeline.png"), "", "",
                        timeline.summarize(per_rank))
    plots.plot_timeline(spans, str(tmp_path / "timeline_plain.png"))  # no summary: no strips

    memory = {"param_bytes": 4 << 20, "grad_bytes": 4 << 20, "optimizer_bytes": 8 << 20,
              "saved_activation_bytes": 10 << 20}
    modes = {"baseline": {"memory_per_rank": [memory]},
             "tp": {"memory_per_rank": [{**memory, "saved_activation_bytes": 5 << 20}] * 2}}
    classic = {"memory_per_rank": [{**memory, "saved_activation_bytes": 7 << 20}] * 2}
    plots.plot_memory(modes, str(tmp_path / "memory.png"), classic)
    plots.plot_memory(modes, str(tmp_path / "memory_plain.png"))
    for name in ("overlap", "timeline", "timeline_plain", "memory", "memory_plain"):
        path = tmp_path / f"{name}.png"
        assert path.exists() and _is_png(path), f"{name}.png not written as a PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{n}.png" for n in ("overlap", "timeline", "timeline_plain", "memory",
                             "memory_plain")), "temporary files left behind"


def _overlap_figure(monkeypatch, bench):
    """plot_overlap's figure, kept open instead of saved, drawn so that extents are known."""
    kept = []
    monkeypatch.setattr(plots, "save", lambda fig, path: kept.append(fig))
    plots.plot_overlap(bench, "unused.png", "loopback")
    fig = kept[0]
    fig.canvas.draw()
    return fig


def test_overlap_figure_says_why_a_block_can_fall_below_its_limit_line(monkeypatch):
    """A block below 1.0 must not read as an op faster than possible: the line at 1.0 is
    labelled the limit for exact times, the region under it is shaded and its legend entry
    names the noise of the limit's own measurement; the legend lies outside the data."""
    row = {"label": "AG+GEMM, column forward", "t_comm_ms": 1.0, "t_gemm_ms": 2.0,
           "overlap_over_max_blocks": {**_dist([0.8, 1.2, 1.4]), "rounds_per_block": 5},
           "basic_over_max_blocks": {**_dist([1.5, 1.6, 1.9]), "rounds_per_block": 5}}
    bench = {"shape": {"s": 8, "b": 2, "h": 16, "f": 32, "p": 2}, "ops": {"column_fwd": row}}
    fig = _overlap_figure(monkeypatch, bench)
    ax = fig.axes[0]
    labels = {text.get_text(): handle for handle, text in
              zip(ax.get_legend().legend_handles, ax.get_legend().get_texts())}
    limit = [t for t in labels if t.startswith("1.0")]
    assert len(limit) == 1 and "exact" in limit[0] and "physical limit" not in limit[0], labels
    below = [t for t in labels if t.startswith("below 1.0")]
    assert len(below) == 1 and "noise" in below[0] and "5 rounds" in below[0], labels
    shaded = [p for p in ax.patches if p.get_label() == below[0]]
    assert shaded, "no shaded region carries the below-1.0 label"
    span = shaded[0]  # y in data coordinates, x across the axes
    ys = span.get_path().transformed(span.get_patch_transform()).vertices[:, 1]
    assert (min(ys), max(ys)) == (pytest.approx(0), pytest.approx(1.0)), ys
    nothing = [line for line in ax.get_lines() if "nothing hidden" in line.get_label()]
    assert nothing and nothing[0].get_ydata()[0] == pytest.approx(1.5), \
        "nothing hidden is (comm + GEMM) / max = 3 / 2"
    legend_box = ax.get_legend().get_window_extent()
    axes_box = ax.get_window_extent()
    assert not legend_box.overlaps(axes_box), (legend_box, axes_box)


BLOG_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "blog", "results", "results.json")


def _results(**meta):
    """The committed default run's results, with `meta` changed."""
    with open(BLOG_RESULTS, encoding="utf-8") as f:
        results = json.load(f)
    results["meta"].update(meta)
    return results


@pytest.mark.parametrize("threads, words", [(2, "baseline (one process, no parallelism) on 2 "
                                                "threads"),
                                           (1, "baseline (one process, no parallelism) on 1 "
                                               "thread")])
def test_summary_header_says_what_each_number_counts(threads, words):
    header = report.summary_text(_results(baseline_threads=threads)).splitlines()[0]
    assert words in header and "1 thread per TP rank" in header, header
    assert not re.search(r"baseline \d", header), header


def _tables(text):
    """{first word of a table's column header: [the lines after it up to a blank line]}."""
    lines, tables = text.splitlines(), {}
    for i, line in enumerate(lines):
        if re.match(r"(mode|op) {2,}", line) or line.startswith("timeline, one block"):
            end = lines.index("", i)
            tables.setdefault(line.split()[0], []).append(lines[i + 1:end])
    return tables


def test_every_table_of_the_summary_ends_with_a_one_line_legend():
    tables = _tables(report.summary_text(_results()))
    found = [(name, body) for name, bodies in tables.items() for body in bodies]
    assert len(found) == 4, f"mode, two overlap tables and the timeline expected: {found}"
    for name, body in found:
        assert body[-1].startswith("  legend: ") and \
            not any("legend" in line for line in body[:-1]), (name, body)


def test_overlap_columns_and_notes_spell_out_when_overlap_cost_time():
    results = _results()
    ops = results["overlap_benchmark"]["ops"]
    ops["column_fwd"].update(hidden=-0.66, hidden_vs_parts=0.39, t_seq_ms=3.0,
                             t_overlap_ms=3.5, t_comm_ms=1.0, t_gemm_ms=2.0)
    for op in ops.values():  # sequential -> overlapped loses time in every op
        op["t_overlap_ms"] = op["t_seq_ms"] + 0.5
    results["targets"] = targets.evaluate_targets(results)
    text = report.summary_text(results)
    row = next(line for line in text.splitlines() if line.startswith(ops["column_fwd"]["label"])
               and "(cost time)" in line)
    assert "-66% (cost time)" in row and re.search(r"\s39%\s", row), row
    assert "hidden vs seq" in text and "hidden vs parts" in text, text
    assert "negative = overlap cost time" in text, "the legend must give the sign's meaning"
    assert not re.search(r"(saves|costs) -\d", text), "a sign the reader must decode"
    assert "(sequential -> overlapped) costs 2.00 ms" in text, text
    assert "costs 0.50 ms against the sequential run (3.00 ms)" in text, text
