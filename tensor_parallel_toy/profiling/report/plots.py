"""The profile's pictures, from the numbers in results.json. Every PNG is written atomically:
to a temporary file in the same folder first, then renamed over the final name."""
import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from ..measure.metrics import MiB  # noqa: E402
from .output import atomic_path  # noqa: E402

STYLE = {  # mode: (color, line style, marker); the TP curves are drawn over the baseline
    "baseline": ("#444444", "-", None),
    "tp": ("#1f77b4", "--", "o"),
    "tp_overlap": ("#ff7f0e", ":", "s"),
    "tp_halves": ("#e377c2", (0, (5, 1, 1, 1)), "D"),
    "dtensor": ("#2ca02c", "-.", "^"),
    "hf_dtensor": ("#d62728", "-.", "v"),
}
SPAN_COLORS = {"gemm": "#1f77b4", "attention": "#9467bd", "other": "#c8c8c8",
               "post": "#8c564b", "wait": "#d62728", "ring": "#ff7f0e",
               "all-gather": "#ff7f0e", "reduce-scatter": "#2ca02c", "all-reduce": "#17becf"}


def save(fig, path):
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)


def _curves(ax, modes, key, every):
    for mode, data in modes.items():
        color, ls, marker = STYLE.get(mode, ("k", "-", None))
        values = data[key]
        ax.plot(range(len(values)), values, color=color, linestyle=ls, marker=marker,
                markevery=every, markersize=4, linewidth=2.5 if mode == "baseline" else 1.5,
                label=mode)


def _curves_and_differences(modes, key, path, *, ylabel, title, diff_ylabel, target=None):
    """modes[.][key] overlaid on top and, below, each TP mode's `{key}_rel_err_vs_baseline`:
    the curves coincide, so only the second panel shows how closely."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    every = max(1, len(next(iter(modes.values()))[key]) // 10)
    _curves(top, modes, key, every)
    top.set_ylabel(ylabel)
    top.set_title(title)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # outside: no curve hidden
    for mode, data in modes.items():
        if data.get(f"{key}_rel_err_vs_baseline"):
            color, ls, marker = STYLE.get(mode, ("k", "-", None))
            bottom.semilogy([max(e, 1e-10) for e in data[f"{key}_rel_err_vs_baseline"]],
                            color=color, linestyle=ls, marker=marker, markevery=every,
                            markersize=4, label=mode)
    if target is not None:  # (value, its label)
        bottom.axhline(target[0], color="#d62728", linewidth=1, label=f"{target[1]} target")
    bottom.set_ylabel(f"{diff_ylabel}\n(exact 0 drawn at 1e-10)")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    save(fig, path)


def plot_losses(modes, path):
    """Loss curves overlaid, and below them each TP mode's relative difference to baseline."""
    _curves_and_differences(modes, "loss", path, ylabel="loss (global mean cross-entropy)",
                            title="Training loss, same weights and data in every mode",
                            diff_ylabel="|loss - baseline| / baseline", target=(1e-4, "1e-4"))


def plot_grad_norms(modes, path):
    """Gradient norms overlaid and, below them, each TP mode's relative difference to the
    baseline's."""
    _curves_and_differences(
        modes, "grad_norm", path, ylabel="global gradient L2 norm",
        title="Gradient norm, computed before zero_grad, replicated parameters once",
        diff_ylabel="|norm - baseline| / baseline")


def plot_step_times(modes, path, network=""):
    names = list(modes)
    med = [modes[m]["step_time"]["median"] * 1e3 for m in names]
    low = [med[i] - modes[m]["step_time"]["p10"] * 1e3 for i, m in enumerate(names)]
    high = [modes[m]["step_time"]["p90"] * 1e3 - med[i] for i, m in enumerate(names)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, med, yerr=[low, high], capsize=6,
                  color=[STYLE.get(m, ("k",))[0] for m in names])
    for bar, m, top in zip(bars, names, (md + hi for md, hi in zip(med, high))):
        ax.annotate(f"{bar.get_height():.1f} ms\n{modes[m]['tokens_per_s']:.0f} tok/s",
                    (bar.get_x() + bar.get_width() / 2, top),  # above the whisker, not on it
                    xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylabel("step time, ms (median, bars p10-p90)")
    ax.set_title("Step time after warm-up, device synchronized, slowest rank"
                 + (f"\n{network}" if network else ""))
    ax.margins(y=0.25)
    save(fig, path)


def plot_memory(modes, path, tp_no_sp=None):
    """Stacked per-rank memory of every mode; with `tp_no_sp` (results.json's memory_tp_no_sp),
    classic TP without sequence parallelism beside the baseline, hatched: one measured step,
    not a training mode."""
    bars = [(m, modes[m]["memory_per_rank"]) for m in modes]
    if tp_no_sp is not None:
        at = 1 if "baseline" in modes else 0
        bars.insert(at, ("tp_no_sp", tp_no_sp["memory_per_rank"]))
    names = [name for name, _ in bars]
    hatches = ["//" if name == "tp_no_sp" else None for name in names]
    parts = [("param_bytes", "parameters", "#1f77b4"), ("grad_bytes", "gradients", "#aec7e8"),
             ("optimizer_bytes", "optimizer state", "#ff7f0e"),
             ("saved_activation_bytes", "saved activations", "#2ca02c")]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    bottom = [0.0] * len(names)
    for key, label, color in parts:
        values = [max(r[key] for r in ranks) / MiB for _, ranks in bars]
        ax.bar(names, values, bottom=bottom, label=label, color=color, hatch=hatches,
               edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, (_, ranks) in enumerate(bars):
        cuda = [r.get("cuda_max_allocated_bytes") for r in ranks]
        if cuda[0] is not None:
            ax.plot(i, max(cuda) / MiB, "k_", markersize=30,
                    label="CUDA max allocated" if i == 0 else None)
        ax.annotate(f"{bottom[i]:.1f}", (i, bottom[i]), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylabel("MiB per rank (largest rank)")
    title = "Memory per rank: state, and activations saved for backward"
    if tp_no_sp is not None:
        title += ("\nhatched: classic TP without sequence parallelism, the baseline converted "
                  "by apply_tensor_parallel, one step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    save(fig, path)


def _spread(ax, x, dist, color, label, width, top):
    """One distribution at `x`: a bar to the median, a p10-p90 whisker, and every value as a
    dot (spread sideways, in a fixed pattern, so that equal values stay visible). Values above
    `top` are drawn at it as triangles, their count above them: one slow round must not flatten
    the rest of the figure."""
    ax.bar(x, dist["median"], width, color=color, alpha=0.35, label=label)
    ax.errorbar(x, dist["median"], yerr=[[dist["median"] - dist["p10"]],
                                         [dist["p90"] - dist["median"]]],
                color=color, capsize=5, linewidth=1.5)
    values = dist.get("values", [])
    offsets = [(i % 7 - 3) / 7 * width * 0.8 for i in range(len(values))]
    inside = [(x + o, v) for o, v in zip(offsets, values) if v <= top]
    above = [(x + o, top) for o, v in zip(offsets, values) if v > top]
    for points, marker in ((inside, "."), (above, "^")):
        if points:
            ax.plot(*zip(*points), marker, color=color, markersize=4 if marker == "." else 5,
                    alpha=0.6, linestyle="none")
    if above:
        ax.annotate(f"+{len(above)}", (x, top), xytext=(0, 5), textcoords="offset points",
                    ha="center", fontsize=7, color=color)
    below = sum(v < 1.0 for v in values)
    if below:  # named at the foot of the shaded region, which the legend explains
        ax.annotate(f"{below} of {len(values)}\nbelow 1.0:\nlimit's noise", (x, 0.04),
                    ha="center", va="bottom", fontsize=6, color=color)
    ax.annotate(f"{dist['median']:.2f}", (x, dist["p90"]), xytext=(0, 3),
                textcoords="offset points", ha="center", fontsize=7)


def plot_overlap(bench, path, network=""):
    """Per op, the package's op time over max(comm alone, GEMM alone), one dot per block of
    rounds: the overlapped schedule and the basic one (whole collectives).

    1.0 is the limit of an op whose times were exact: it cannot take less than the longer of
    its transfers and its GEMMs. But each block's limit is measured too, from the medians of
    that block's own comm-alone and GEMM-alone rounds, and its noise reaches the ratio: a block
    whose limit came out slow can fall below 1.0. The figure says so, shading the region below
    the line, rather than let a dot there read as an op faster than possible. A short dashed
    line per op marks (comm + GEMM) / max, where nothing is hidden."""
    ops = list(bench["ops"])
    series = [("overlap_over_max_blocks", "overlapped", STYLE["tp_overlap"][0]),
              ("basic_over_max_blocks", "basic (whole collectives)", STYLE["tp"][0])]
    width = 0.35
    top = 1.4 * max(bench["ops"][o][key]["p90"] for o in ops for key, _, _ in series)
    top = max(top, 2.2)  # room for the nothing-hidden lines, at most 2.0
    k = bench["ops"][ops[0]][series[0][0]]["rounds_per_block"]
    fig, ax = plt.subplots(figsize=(8.5, 5))
    ax.axhspan(0, 1.0, color="#e8e8e8", zorder=0,
               label=f"below 1.0: faster than the limit, possible only through noise in the "
                     f"limit's own measurement\n(a block's comm and GEMM alone are medians of "
                     f"{k} rounds, as noisy as the op's)")
    for j, (key, label, color) in enumerate(series):
        for i, o in enumerate(ops):
            _spread(ax, i + (j - 0.5) * width, bench["ops"][o][key], color,
                    label if i == 0 else None, width, top)
    ax.axhline(1.0, color="k", linewidth=1, linestyle="--",
               label="1.0: max(comm alone, GEMM alone), the limit for exact times\n(all of the "
                     "shorter part hidden)")
    ticks = []
    for i, o in enumerate(ops):
        row = bench["ops"][o]
        longer = max(row["t_comm_ms"], row["t_gemm_ms"])
        nothing = (row["t_comm_ms"] + row["t_gemm_ms"]) / longer
        ax.plot([i - 1.1 * width, i + 1.1 * width], [nothing] * 2,
                color="#7f7f7f", linewidth=1.2, linestyle=(0, (4, 2)),
                label="(comm + GEMM alone) / max: nothing hidden" if i == 0 else None)
        name = "comm" if row["t_comm_ms"] > row["t_gemm_ms"] else "GEMM"
        ticks.append(f"{row['label'].replace(', ', chr(10))}\nmax: {name} {longer:.2f} ms")
    ax.set_xticks(range(len(ops)), ticks, fontsize=8)
    first = bench["ops"][ops[0]][series[0][0]]
    shape = bench["shape"]
    ax.set_ylabel("op time / max(comm alone, GEMM alone)")
    ax.set_ylim(0, top * 1.1)
    ax.set_title(f"Per-op overlap, slowest rank: a dot per block of {k} rounds "
                 f"({first['n']} blocks; bar: median, whisker: p10-p90)\n"
                 f"s={shape['s']} b={shape['b']} h={shape['h']} m={shape['f']} p={shape['p']}"
                 + (f", {network}" if network else ""), fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    save(fig, path)


def _recordings_strip(ax, over, color):
    """Every recording of one mode as a dot, its block time and its time blocked in
    communication (slowest rank of each recording); a tick at each median."""
    rows = [("total_ms", "block total"), ("blocked_in_comm_ms", "blocked in comm")]
    for y, (key, _) in enumerate(rows):
        dist = over[key]
        ax.plot(dist["values"], [y] * len(dist["values"]), "o", color=color, markersize=4,
                alpha=0.6)
        ax.plot([dist["median"]] * 2, [y - 0.3, y + 0.3], color="k", linewidth=1.5)
    ax.set_yticks(range(len(rows)), [label for _, label in rows], fontsize=8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_title(f"{over['total_ms']['n']} recordings (|: median)", fontsize=9, loc="left")
    ax.tick_params(axis="x", labelsize=8)


def plot_timeline(spans_by_mode, path, title_extra="", network="", summary=None):
    """Gantt chart: one panel per mode, rows = (rank, compute) and (rank, comm). With `summary`
    (results.json's timeline.summary), a strip beside each panel shows every recording."""
    modes = list(spans_by_mode)
    ranks = len(spans_by_mode[modes[0]])
    end = max(s["end"] for m in modes for r in spans_by_mode[m] for s in r)
    strips = summary is not None and all("over_recordings" in summary[m] for m in modes)
    fig, axes = plt.subplots(len(modes), 2 if strips else 1,
                             figsize=(15 if strips else 12, 1.0 + 1.1 * ranks * len(modes)),
                             sharex="col", squeeze=False,
                             gridspec_kw={"width_ratios": [5, 1]} if strips else None)
    if strips:
        for ax, mode in zip(axes[:, 1], modes):
            _recordings_strip(ax, summary[mode]["over_recordings"],
                              STYLE.get(mode, ("k",))[0])
        axes[-1, 1].set_xlabel("ms")
    for ax, mode in zip(axes[:, 0], modes):
        labels = []
        for rank, spans in enumerate(spans_by_mode[mode]):
            base = (ranks - 1 - rank) * 2.4
            rows = {"compute": base + 1.2, "comm": base}
            labels += [(rows["compute"] + 0.4, f"rank {rank} compute"),
                       (rows["comm"] + 0.4, f"rank {rank} comm")]
            for s in spans:
                if s["row"] == "marker":
                    if s["kind"] == "forward_end":
                        ax.axvline(s["start"], color="k", linestyle=":", linewidth=0.8)
                    continue
                y = rows[s["row"]]
                ax.broken_barh([(s["start"], max(s["end"] - s["start"], 1e-3))], (y, 0.8),
                               facecolors=SPAN_COLORS.get(s["kind"], "#888888"),
                               edgecolor="none",
                               alpha=0.55 if s["row"] == "comm" else 1.0,
                               hatch="///" if s["kind"] == "wait" else None)
        total = max(s["end"] for r in spans_by_mode[mode] for s in r if s["kind"] == "end")
        ax.set_title(f"{mode}: {total:.1f} ms for one block forward + backward, in the recording "
                     f"with the median block time (dotted lines: where each rank's forward "
                     f"ends)", fontsize=10, loc="left")
        ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=8)
        ax.set_xlim(0, end * 1.01)
    axes[-1, 0].set_xlabel("ms" + title_extra)
    if network:
        fig.suptitle(f"Timeline over {network}", fontsize=11)
    labels = {"post": "posting a transfer", "wait": "blocked waiting for one",
              "ring": "transfer in flight: ring send/recv or all-gather",
              "reduce-scatter": "reduce-scatter in flight", "all-reduce": "all-reduce in flight"}
    handles = [Patch(facecolor=c, alpha=0.55 if k in ("ring", "reduce-scatter", "all-reduce")
                     else 1.0,
                     hatch="///" if k == "wait" else None, label=labels.get(k, k))
               for k, c in SPAN_COLORS.items() if k != "all-gather"]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8,
               bbox_to_anchor=(0.5, -0.04))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    save(fig, path)


def plot_sweep(sweep, path):
    """Step time of tp and tp_overlap against the link rate, loopback as its own lines, and
    the two limits: comm-bound (bytes per step / the rate one TCP stream measured on the link,
    which is below the nominal one) and compute-bound."""
    rates = [p["rate_bits_per_s"] / 1e9 for p in sweep["rates"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in ("tp", "tp_overlap"):
        color, ls, marker = STYLE[mode]
        med = [p[mode]["median_s"] * 1e3 for p in sweep["rates"]]
        low = [m - p[mode]["p10_s"] * 1e3 for m, p in zip(med, sweep["rates"])]
        high = [p[mode]["p90_s"] * 1e3 - m for m, p in zip(med, sweep["rates"])]
        ax.errorbar(rates, med, yerr=[low, high], color=color, linestyle="-", marker=marker,
                    capsize=4, label=f"{mode} over the link (median, p10-p90)")
        ax.axhline(sweep["loopback"][mode]["median_s"] * 1e3, color=color, linestyle=ls,
                   linewidth=1, label=f"{mode} over loopback")
    measured = [p["measured_bits_per_s"] for p in sweep["rates"]]
    ax.plot(rates, [sweep["bytes_per_step_derived"] * 8 / m * 1e3 for m in measured],
            color="#d62728", linewidth=1.5,
            label=f"comm-bound: {sweep['bytes_per_step_derived'] / MiB:.1f} MiB per step "
                  f"(derived from the shapes) / measured rate")
    tp_bytes = [p["tp"]["veth_tx_bytes_per_step"] for p in sweep["rates"]]
    ax.plot(rates, [b * 8 / m * 1e3 for b, m in zip(tp_bytes, measured)],
            color="#d62728", linewidth=1, linestyle="--",
            label=f"comm-bound of tp as gloo sends it: {max(tp_bytes) / MiB:.1f} MiB per "
                  f"step measured on the veth / measured rate")
    ax.axhline(sweep["compute_bound_s"] * 1e3, color="#444444", linewidth=1.5,
               label="compute-bound: loopback tp minus its blocked time")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.set_xlabel("link rate, Gbit/s (tc tbf on every rank's egress)")
    ax.set_ylabel("step time, ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"When overlap pays: TP={sweep['meta']['tp']}, batch {sweep['meta']['batch']} "
                 f"x seq {sweep['meta']['seq']}, {sweep['meta']['dtype']}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # off the data
    save(fig, path)


def plot_wire_sweep(sweep, path):
    """The column forward on the modeled wire, time / GEMM alone against comm / GEMM alone:
    measured per number of ring pieces m, the schedule bound for each m, and the two lines
    every schedule lies between (nothing hidden, and max(comm, GEMM))."""
    points = sweep["points"]
    pieces = sorted({q["pieces"] for q in points})
    colors = plt.get_cmap("viridis")([0.85 * i / max(1, len(pieces) - 1)
                                      for i in range(len(pieces))])
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ratios = sorted(q["comm_over_gemm"] for q in points)
    grid = [ratios[0] * (ratios[-1] / ratios[0]) ** (i / 60) for i in range(61)]
    ax.plot(grid, [1 + x for x in grid], color="#888888", linewidth=1.2, linestyle=":",
            label="nothing hidden: comm + GEMM")
    ax.plot(grid, [max(1.0, x) for x in grid], color="#d62728", linewidth=1.5,
            label="the limit: max(comm, GEMM)")
    for m, color in zip(pieces, colors):
        mine = sorted((q for q in points if q["pieces"] == m), key=lambda q: q["comm_over_gemm"])
        x = [q["comm_over_gemm"] for q in mine]
        ax.plot(x, [q["bound_ms"] / q["t_gemm_ms"] for q in mine], color=color, linewidth=1,
                linestyle="--", label=f"schedule bound, {m} piece{'s' if m > 1 else ''}")
        ax.plot(x, [q["t_overlap_ms"] / q["t_gemm_ms"] for q in mine], color=color,
                marker="o", linewidth=1.5, label=f"measured, overlap={m}")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=2))  # 0.25, 0.5, 1, 2, 4: no crowded labels
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("comm / GEMM, each alone (the wire's rate sets comm)")
    ax.set_ylabel("op time / GEMM alone")
    ax.set_ylim(bottom=0)
    sh = sweep["shape"]
    ax.set_title(f"Column forward (all-gather + GEMM), p={sh['p']}, on a MODELED wire (not a "
                 f"network):\ncompute-bound on the left, communication-bound on the right",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    save(fig, path)
