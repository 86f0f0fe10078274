"""The profile's pictures, from the numbers in results.json. Every PNG is written atomically:
to a temporary file in the same folder first, then renamed over the final name."""
import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .output import atomic_path  # noqa: E402

STYLE = {  # mode: (color, line style, marker); the TP curves are drawn over the baseline
    "baseline": ("#444444", "-", None),
    "tp": ("#1f77b4", "--", "o"),
    "tp_overlap": ("#ff7f0e", ":", "s"),
    "dtensor": ("#2ca02c", "-.", "^"),
    "hf_dtensor": ("#d62728", "-.", "v"),
}
SPAN_COLORS = {"gemm": "#1f77b4", "attention": "#9467bd", "other": "#c8c8c8",
               "post": "#8c564b", "wait": "#d62728", "ring": "#ff7f0e",
               "all-gather": "#ff7f0e", "reduce-scatter": "#2ca02c", "all-reduce": "#17becf"}
MiB = 2 ** 20


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


def plot_losses(modes, path):
    """Loss curves overlaid, and below them each TP mode's relative difference to baseline."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    every = max(1, len(next(iter(modes.values()))["loss"]) // 10)
    _curves(top, modes, "loss", every)
    top.set_ylabel("loss (global mean cross-entropy)")
    top.set_title("Training loss, same weights and data in every mode")
    top.legend()
    for mode, data in modes.items():
        if data.get("loss_rel_err_vs_baseline"):
            color, ls, marker = STYLE.get(mode, ("k", "-", None))
            bottom.semilogy([max(e, 1e-10) for e in data["loss_rel_err_vs_baseline"]],
                            color=color, linestyle=ls, marker=marker, markevery=every,
                            markersize=4, label=mode)
    bottom.axhline(1e-4, color="#d62728", linewidth=1, label="1e-4 target")
    bottom.set_ylabel("|loss - baseline| / baseline\n(exact 0 drawn at 1e-10)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    save(fig, path)


def plot_grad_norms(modes, path):
    fig, ax = plt.subplots(figsize=(7, 4))
    _curves(ax, modes, "grad_norm", max(1, len(next(iter(modes.values()))["grad_norm"]) // 10))
    ax.set_xlabel("step")
    ax.set_ylabel("global gradient L2 norm")
    ax.set_title("Gradient norm, computed before zero_grad, replicated parameters once")
    ax.legend()
    save(fig, path)


def plot_step_times(modes, path, network=""):
    names = list(modes)
    med = [modes[m]["step_time"]["median"] * 1e3 for m in names]
    low = [med[i] - modes[m]["step_time"]["p10"] * 1e3 for i, m in enumerate(names)]
    high = [modes[m]["step_time"]["p90"] * 1e3 - med[i] for i, m in enumerate(names)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, med, yerr=[low, high], capsize=6,
                  color=[STYLE.get(m, ("k",))[0] for m in names])
    for bar, m in zip(bars, names):
        ax.annotate(f"{bar.get_height():.1f} ms\n{modes[m]['tokens_per_s']:.0f} tok/s",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylabel("step time, ms (median, bars p10-p90)")
    ax.set_title("Step time after warm-up, device synchronized, slowest rank"
                 + (f"\n{network}" if network else ""))
    ax.margins(y=0.25)
    save(fig, path)


def plot_memory(modes, path):
    names = list(modes)
    parts = [("param_bytes", "parameters", "#1f77b4"), ("grad_bytes", "gradients", "#aec7e8"),
             ("optimizer_bytes", "optimizer state", "#ff7f0e"),
             ("saved_activation_bytes", "saved activations", "#2ca02c")]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(names)
    for key, label, color in parts:
        values = [max(r[key] for r in modes[m]["memory_per_rank"]) / MiB for m in names]
        ax.bar(names, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, m in enumerate(names):
        cuda = [r.get("cuda_max_allocated_bytes") for r in modes[m]["memory_per_rank"]]
        if cuda[0] is not None:
            ax.plot(i, max(cuda) / MiB, "k_", markersize=30,
                    label="CUDA max allocated" if i == 0 else None)
        ax.annotate(f"{bottom[i]:.1f}", (i, bottom[i]), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=8)
    ax.set_ylabel("MiB per rank (largest rank)")
    ax.set_title("Memory per rank: state, and activations saved for backward")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    save(fig, path)


def plot_overlap(bench, path, network=""):
    ops = list(bench["ops"])
    variants = [("t_comm_ms", "comm alone"), ("t_gemm_ms", "GEMM alone"),
                ("t_seq_ms", "sequential"), ("t_overlap_ms", "overlapped")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for j, (key, label) in enumerate(variants):
        ax.bar([i + (j - 1.5) * width for i in range(len(ops))],
               [bench["ops"][o][key] for o in ops], width, label=label)
    for i, o in enumerate(ops):
        row = bench["ops"][o]
        ax.annotate(f"hidden {row['hidden']:.0%}", (i, max(row["t_seq_ms"], row["t_overlap_ms"])),
                    xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(range(len(ops)), [bench["ops"][o]["label"].replace(", ", "\n") for o in ops],
                  fontsize=8)
    shape = bench["shape"]
    ax.set_ylabel("ms (median, slowest rank)")
    ax.set_title(f"Per-op overlap, s={shape['s']} b={shape['b']} h={shape['h']} "
                 f"f={shape['f']} p={shape['p']}" + (f", {network}" if network else ""))
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    save(fig, path)


def plot_timeline(spans_by_mode, path, title_extra="", network=""):
    """Gantt chart: one panel per mode, rows = (rank, compute) and (rank, comm)."""
    modes = list(spans_by_mode)
    ranks = len(spans_by_mode[modes[0]])
    end = max(s["end"] for m in modes for r in spans_by_mode[m] for s in r)
    fig, axes = plt.subplots(len(modes), 1, figsize=(12, 1.0 + 1.1 * ranks * len(modes)),
                             sharex=True, squeeze=False)
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
        ax.set_title(f"{mode}: {total:.1f} ms for one block forward + backward "
                     f"(dotted line: end of forward)", fontsize=10, loc="left")
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
    the two limits: comm-bound (bytes per step / rate) and compute-bound."""
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
    dense = [rates[0] * (rates[-1] / rates[0]) ** (i / 50) for i in range(51)]
    ax.plot(dense, [sweep["bytes_per_step_derived"] * 8 / (r * 1e9) * 1e3 for r in dense],
            color="#d62728", linewidth=1.5,
            label=f"comm-bound: {sweep['bytes_per_step_derived'] / 2 ** 20:.1f} MiB per step "
                  f"(derived from the shapes) / rate")
    tp_bytes = [p["tp"]["veth_tx_bytes_per_step"] for p in sweep["rates"]]
    ax.plot(rates, [b * 8 / (r * 1e9) * 1e3 for b, r in zip(tp_bytes, rates)],
            color="#d62728", linewidth=1, linestyle="--",
            label=f"comm-bound of tp as gloo sends it: {max(tp_bytes) / 2 ** 20:.1f} MiB per "
                  f"step measured on the veth / rate")
    ax.axhline(sweep["compute_bound_s"] * 1e3, color="#444444", linewidth=1.5,
               label="compute-bound: loopback tp minus its blocked time")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.set_xlabel("link rate, Gbit/s (tc tbf on every rank's egress)")
    ax.set_ylabel("step time, ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"When overlap pays: TP={sweep['meta']['tp']}, batch {sweep['meta']['batch']} "
                 f"x seq {sweep['meta']['seq']}, {sweep['meta']['dtype']}")
    ax.legend(fontsize=7)
    save(fig, path)
