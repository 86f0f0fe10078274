"""The blog's conceptual figures, drawn by code: the splits, the collectives, the regions of a
block, the two rings (concepts_rings.py), the activation memory per saved tensor, and the two
halves (concepts_halves.py): their schedule and autograd's mirror of it, and what the rings can
hide in a block against what any schedule could.

    python -m tensor_parallel_toy.post.concepts blog/figures

writes them all (`draw_all`). Each PNG carries the hash of the source it was drawn from
(sketch.py says which files): `stale_figures` names every figure that is missing or was drawn
from other source, without looking at file times, which a fresh clone does not keep.
"""
import os
import sys

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from ..profiling.measure import memory_model
from .concepts_halves import draw_ceiling_vs_limit, draw_halves_mirror
from .concepts_rings import draw_ring_all_gather_gemm, draw_ring_pieces, draw_ring_reduce_scatter
from .sketch import (COMM, RANK_EDGE, RANK_FILL, SOURCE_KEY, SUM, WIDTH_IN, arrow, box, canvas,
                     rounded, save, source_hash, styled)

REGION_FILL = {memory_model.REPLICATED: "#ececec", memory_model.SEQUENCE_PARALLEL: "#e5f5e0",
               memory_model.TENSOR_PARALLEL: "#deebf7"}


# -- 1. column and row parallel ------------------------------------------------------------------
@styled
def draw_column_row_split(path):
    """Y = X Wᵀ split two ways over p = 2 ranks, every block labelled with its shape."""
    fig, ax = canvas(20, 13)
    n, din, dout = 3.0, 2.4, 3.2  # drawn sizes of the token, input and output dims
    x_w, x_eq = 3.6, 7.3  # where Wᵀ starts, where "=" stands

    # Column-parallel: W's output rows (Wᵀ's columns) split; every rank needs all of X.
    y0 = 8.0
    ax.text(0.3, 12.4, "Column-parallel: rank r keeps W's output rows, "
            r"$W_r$ [out/p, in]  (p = 2)", fontsize=11, weight="bold", va="center")
    box(ax, 0.4, y0, din, n, "$X$\n[sb, in]\n\nthe whole X,\non every rank")
    ax.text(3.2, y0 + n / 2, "·", fontsize=18, ha="center", va="center")
    for r in range(2):
        box(ax, x_w + r * dout / 2, y0 + (n - din) / 2, dout / 2, din,
             f"$W_{r}^T$\n[in, out/p]", RANK_FILL[r], RANK_EDGE[r])
    ax.text(x_eq, y0 + n / 2, "=", fontsize=16, ha="center", va="center")
    for r in range(2):
        box(ax, x_eq + 0.4 + r * dout / 2, y0, dout / 2, n, f"$Y_{r}$\n[sb, out/p]\n\nrank {r}",
             RANK_FILL[r], RANK_EDGE[r])
    ax.text(11.4, y0 + n, "\n".join([
        r"rank r computes $Y_r = X\,W_r^T$:  [sb, in] · [in, out/p]",
        "",
        "Forward: no communication. The column blocks",
        "side by side are Y, each on the rank that made it.",
        "",
        r"Backward: $dX = \Sigma_r\, dY_r\,W_r$, one term per rank:",
        "summed over the ranks: an all-reduce",
        "(section 3's f)."]), va="top", fontsize=9)

    # Row-parallel: W's input columns (Wᵀ's rows) split, with X's matching feature slices.
    y0 = 2.2
    ax.axhline(6.9, color="#999999", linewidth=0.8)
    ax.text(0.3, 6.3, "Row-parallel: rank r keeps W's input columns, "
            r"$W[:, r]$ [out, in/p], and needs only $X[:, r]$", fontsize=11, weight="bold",
            va="center")
    for r in range(2):
        box(ax, 0.4 + r * din / 2, y0, din / 2, n, f"$X[:, {r}]$\n[sb,\nin/p]",
             RANK_FILL[r], RANK_EDGE[r])
    ax.text(3.2, y0 + n / 2, "·", fontsize=18, ha="center", va="center")
    for r in range(2):
        box(ax, x_w, y0 + (n - din) / 2 + (1 - r) * din / 2, dout, din / 2,
             f"$W[:, {r}]^T$  [in/p, out]", RANK_FILL[r], RANK_EDGE[r])
    ax.text(x_eq, y0 + n / 2, "→", fontsize=16, ha="center", va="center")
    for r in range(2):
        x = x_eq + 0.4 + r * (dout + 0.6)
        box(ax, x, y0, dout, n, f"$P_{r} = X[:, {r}]\\,W[:, {r}]^T$\n[sb, out]\nrank {r}\n\n"
             "full size,\na partial sum", RANK_FILL[r], RANK_EDGE[r])
    ax.text(x_eq + 0.4 + dout + 0.3, y0 + n / 2, "+", fontsize=16, ha="center", va="center")
    ax.text(x_eq + 0.4 + 2 * dout + 0.9, y0 + n / 2, "=", fontsize=16, ha="center",
            va="center")
    box(ax, x_eq + 2 * dout + 1.6, y0, dout, n, "$Y = P_0 + P_1$\n[sb, out]", SUM)
    ax.text(0.4, 1.3, "Forward: the sum is the communication: an all-reduce, which leaves Y on "
            "every rank (section 3's g).", fontsize=9, va="center")
    ax.text(0.4, 0.3, "Backward: every rank needs all of dY, already on every rank (the "
            r"identity);  $dX[:, r] = dY\,W[:, r]$,  $dW[:, r] = dY^T X[:, r]$.", fontsize=9,
            va="center")
    save(fig, path)


# -- 2. the collectives ---------------------------------------------------------------------------
def _grid(ax, x, y, cells, cell_w=0.95, cell_h=0.62):
    """cells[r][k] = (text, fill) or None (empty), rank 0 on top."""
    p = len(cells)
    for r, row in enumerate(cells):
        yr = y + (p - 1 - r) * (cell_h + 0.12)
        for k, cell in enumerate(row):
            if cell is None:
                box(ax, x + k * cell_w, yr, cell_w, cell_h, fill="white", edge="#bbbbbb",
                     dashed=True)
            else:
                text, fill = cell
                box(ax, x + k * cell_w, yr, cell_w, cell_h, text, fill, size=9)


@styled
def draw_collectives(path):
    """All-gather, reduce-scatter and all-reduce over p = 4 ranks: what each rank holds before
    and after, the bytes each rank sends, and the conjugate pairs."""
    p = 4
    fig, ax = canvas(20, 17)
    letters = "ABCD"
    gathered = [[(f"$X_{k}$", RANK_FILL[k]) for k in range(p)] for _ in range(p)]
    own = [[(f"$X_{r}$", RANK_FILL[r]) if k == r else None for k in range(p)] for r in range(p)]
    partials = [[(f"${letters[r]}_{k}$", RANK_FILL[r]) for k in range(p)] for r in range(p)]
    summed = [[(f"$\\Sigma_{k}$", SUM) if k == r else None for k in range(p)] for r in range(p)]
    everywhere = [[(f"$\\Sigma_{k}$", SUM) for k in range(p)] for _ in range(p)]
    bands = [
        ("all-gather", own, gathered,
         ["each rank sends (p−1)/p · N = 3/4 N", "N: the whole gathered tensor", "",
          "backward: reduce-scatter"]),
        ("reduce-scatter", partials, summed,
         ["each rank sends (p−1)/p · N = 3/4 N", "N: one rank's whole input", "",
          "backward: all-gather"]),
        ("all-reduce", partials, everywhere,
         ["= reduce-scatter, then all-gather:", "each rank sends 2(p−1)/p · N = 3/2 N", "",
          "backward: all-reduce of the gradients", "when ranks use the sum differently;",
          "the identity when all use it alike (g)"]),
    ]
    for i, (name, before, after, notes) in enumerate(bands):
        top = 16.1 - i * 4.8
        ax.text(0.3, top, name, fontsize=12, weight="bold", va="center")
        y = top - 3.6
        for r in range(p):
            ax.text(1.5, y + (p - 1 - r) * 0.74 + 0.31, f"rank {r}", ha="right", va="center")
        ax.text(1.7 + 2 * 0.95, top - 0.45, "before", ha="center", va="center",
                color="#555555")
        ax.text(8.5 + 2 * 0.95, top - 0.45, "after", ha="center", va="center", color="#555555")
        _grid(ax, 1.7, y, before)
        arrow(ax, (5.8, y + 1.45), (8.2, y + 1.45), width=2)
        ax.text(7.0, y + 1.75, name, ha="center", va="bottom", fontsize=9)
        _grid(ax, 8.5, y, after)
        ax.text(13.0, top - 0.6, "\n".join(notes), va="top", fontsize=9.5)
    ax.text(0.3, 1.6, r"$A_k, B_k, C_k, D_k$: chunk k of rank 0, 1, 2, 3's own tensor;  "
            r"$\Sigma_k = A_k + B_k + C_k + D_k$.", fontsize=9.5, va="center")
    ax.text(0.3, 1.0, "Conjugate pair: all-gather ↔ reduce-scatter, each one the other's "
            "backward.", fontsize=9.5, va="center", weight="bold")
    ax.text(0.3, 0.4, "All-reduce = reduce-scatter + all-gather: sequence parallelism moves "
            "the all-gather past the norm, same bytes.", fontsize=9.5, va="center")
    save(fig, path)


# -- 2b. the transposes, as block matrices --------------------------------------------------------
def _matrix(ax, x, y, rows, cell=0.62):
    """A block matrix, rows[i][j] = "I" or "0", its top-left corner at (x, y)."""
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            box(ax, x + j * cell, y - (i + 1) * cell, cell, cell, value,
                SUM if value == "I" else "white", size=9)
    return x + len(rows[0]) * cell, y - len(rows) * cell


@styled
def draw_transposes(path):
    """Each communication operator at p = 2 as a block matrix acting on the stacked blocks of
    both ranks, and its backward as the transposed matrix: f and g, all-gather and
    reduce-scatter (section 4 runs the last two along the sequence)."""
    fig, ax = canvas(20, 13.0)
    gather = [["I", "0"], ["0", "I"], ["I", "0"], ["0", "I"]]
    scatter = [["I", "0", "I", "0"], ["0", "I", "0", "I"]]
    bands = [
        ("f (copy)", "x, one value", [["I"], ["I"]], "[x on rank 0; x on rank 1]",
         "sums the two gradients;", "x is on every rank:",
         "all-reduce"),
        ("g (reduce)", "[a on rank 0; b on rank 1]", [["I", "I"]], "y = a + b, one value",
         "copies dy to both terms;", "dy is on every rank:", "identity"),
        ("all-gather", "[x0 on rank 0; x1 on rank 1]", gather,
         "[x0; x1 on rank 0; x0; x1 on rank 1]", "sums block r's gradients",
         "onto rank r:", "reduce-scatter"),
        ("reduce-scatter", "[a0; a1 on rank 0; b0; b1 on rank 1]", scatter,
         "[a0 + b0 on rank 0; a1 + b1 on rank 1]", "sends both blocks of dy", "to every rank:",
         "all-gather"),
    ]
    top = 12.3
    ax.text(0.3, 12.65, "Forward: out = M · in.   Backward: d(in) = Mᵀ · d(out).   "
            "(p = 2; I an identity block, 0 a zero block)", fontsize=10.5, weight="bold",
            va="center")
    for name, src, rows, dst, why1, why2, backward in bands:
        ax.text(0.3, top - 0.45, name, fontsize=11, weight="bold", va="center")
        ax.text(0.3, top - 0.95, f"in: {src}", fontsize=8.5, va="center")
        ax.text(0.3, top - 1.35, f"out: {dst}", fontsize=8.5, va="center")
        ax.text(8.6, top - 0.2, "M", fontsize=10, ha="center", va="center")
        _, bottom_m = _matrix(ax, 8.3 - 0.31 * (len(rows[0]) - 1), top - 0.5, rows)
        transposed = [list(col) for col in zip(*rows)]
        ax.text(12.3, top - 0.2, "Mᵀ", fontsize=10, ha="center", va="center")
        _, bottom_t = _matrix(ax, 12.0 - 0.31 * (len(transposed[0]) - 1), top - 0.5,
                              transposed)
        ax.text(14.0, top - 0.8, "\n".join(l for l in (why1, why2) if l), fontsize=8.5,
                va="top")
        ax.text(14.0, top - 1.9, f"backward: {backward}", fontsize=9.5, weight="bold",
                va="center", color="#a65d00")
        top = min(bottom_m, bottom_t) - 0.7
        ax.axhline(top + 0.35, color="#cccccc", linewidth=0.8)
    save(fig, path)


# -- 3. the regions of one block ------------------------------------------------------------------
REP, SPR, TPR = (memory_model.REPLICATED, memory_model.SEQUENCE_PARALLEL,
                 memory_model.TENSOR_PARALLEL)
REGION_LABEL = {REP: "replicated: [s, b, h] on every rank",
                SPR: "sequence-parallel: this rank's s/p tokens",
                TPR: "tensor-parallel: this rank's heads / features"}
HEIGHT = {"tensor": 0.7, "op": 0.8, "add": 0.8, "comm": 1.45}


def _block_items(sequence_parallel):
    """(kind, text, region) from the block's input down to its output."""
    if sequence_parallel:
        rows, region, x = "[s/p, b, h]", SPR, "x  [s/p, b, h], this rank's tokens"
        enter = ("all-gather(seq)   [s/p, b, h] → [s, b, h]\n"
                 "fwd: all-gather(seq) | bwd: reduce-scatter(seq)\n"
                 "+ bwd: all-gather(seq) again, of the saved x shard")
        leave = ("reduce-scatter(seq)   [s, b, h] → [s/p, b, h]\n"
                 "fwd: reduce-scatter(seq) | bwd: all-gather(seq)\n"
                 "in RowParallelLinear")
    else:
        rows, region, x = "[s, b, h]", REP, "x  [s, b, h], same on every rank"
        enter = ("f = copy_to_tensor_parallel_region\n"
                 "fwd: identity | bwd: all-reduce\nShoeybi's f")
        leave = ("g = reduce_from_tensor_parallel_region\n"
                 "fwd: all-reduce | bwd: identity\nShoeybi's g")
    return [("tensor", x, region),
            ("op", f"attn_norm (RMSNorm)   {rows}", region),
            ("comm", enter, None),
            ("op", "qkv (column)  →  [s, b, 3h/p]", TPR),
            ("op", "attention, a/p heads  →  [s, b, h/p]", TPR),
            ("op", "proj (row)  →  partial sums [s, b, h]", TPR),
            ("comm", leave, None),
            ("add", f"+ residual  →  {rows}", region),
            ("op", f"mlp_norm (RMSNorm)   {rows}", region),
            ("comm", enter, None),
            ("op", "fc1 (column)  →  [s, b, m/p]", TPR),
            ("op", "GELU   [s, b, m/p]", TPR),
            ("op", "fc2 (row)  →  partial sums [s, b, h]", TPR),
            ("comm", leave, None),
            ("add", f"+ residual  →  {rows}", region)]


def _draw_block(ax, x0, top, items, gap=0.45, width=9.4):
    """One column of the figure: the items top to bottom, regions shaded behind them."""
    cx, y, centres = x0 + width / 2 - 0.2, top, []
    for kind, _, region in items:
        h = HEIGHT[kind]
        if region is not None:  # shade the slot, gaps included, so a region reads as a band
            ax.add_patch(Rectangle((x0, y - h - gap / 2), width, h + gap,
                                   facecolor=REGION_FILL[region], edgecolor="none"))
        centres.append((y - h / 2, h))
        y -= h + gap
    for i, ((kind, text, region), (yc, h)) in enumerate(zip(items, centres)):
        if kind == "comm":
            rounded(ax, cx - 3.9, yc - h / 2, 7.8, h, text, size=8)
        elif kind == "tensor":
            ax.text(cx, yc, text, ha="center", va="center", fontsize=9, style="italic")
        else:
            box(ax, cx - 3.3, yc - h / 2, 6.6, h, text,
                 fill="white" if kind == "add" else "#f7f7f7", size=8.5)
        if i + 1 < len(items):
            below, hb = centres[i + 1]
            arrow(ax, (cx, yc - h / 2), (cx, below + hb / 2), width=1)
    # The residual stream bypasses each sub-block, from its input to the "+": the first from
    # the block's input, the second from the first "+" (drawn inset, so the two paths do not
    # merge into one line from the input).
    adds = [i for i, item in enumerate(items) if item[0] == "add"]
    starts = [0] + adds[:-1]
    for k, (start, end) in enumerate(zip(starts, adds)):
        xr = x0 + width - 0.25 - 0.35 * k
        ys, ye = centres[start][0] - 0.18 * k, centres[end][0]
        x_from = cx + 3.3  # the right edge of a box, or past the end of the input's label
        ax.plot([x_from, xr, xr], [ys, ys, ye], color="#666666", linewidth=1)
        arrow(ax, (xr, ye), (cx + 3.3, ye), color="#666666", width=1)


@styled
def draw_regions(path):
    """One transformer block under TP (Shoeybi et al.) and TP + SP (Korthikanti et al.): the
    regions each tensor lives in, and the collectives between them, forward and backward."""
    fig, ax = canvas(20, 25.4)
    titles = ["TP (Shoeybi et al. 2019)", "TP + SP (Korthikanti et al. 2022)"]
    for col, sequence_parallel in enumerate((False, True)):
        x0 = 0.2 + col * 10.0
        ax.text(x0 + 4.5, 24.9, titles[col], ha="center", va="center", fontsize=11.5,
                weight="bold")
        _draw_block(ax, x0, 24.3, _block_items(sequence_parallel))
    ax.text(0.3, 2.8, "Forward, per block: TP runs 2 all-reduces, TP + SP 2 all-gathers and "
            "2 reduce-scatters, the same bytes (its backward", fontsize=9, va="center")
    ax.text(0.3, 2.35, "adds 2 all-gathers: the column layers re-gather the input shard they "
            "saved). With SP the norms and residuals", fontsize=9, va="center")
    ax.text(0.3, 1.9, "hold s/p tokens instead of all s: their activations shrink by p too.",
            fontsize=9, va="center")
    handles = [Patch(facecolor=REGION_FILL[r], edgecolor="#999999", label=REGION_LABEL[r])
               for r in (REP, SPR, TPR)]
    handles.append(Patch(facecolor=COMM, edgecolor="#a65d00",
                         label="communication: forward | backward"))
    ax.legend(handles=handles, loc="lower center", ncol=2, fontsize=8.5, frameon=False,
              bbox_to_anchor=(0.5, -0.01))
    save(fig, path)


# -- 6. activation memory per saved tensor ---------------------------------------------------------
TENSOR_COLORS = {  # norms in greys, attention in blues, the MLP in oranges
    "norms: input x": "#525252", "norms: x·rms": "#7f7f7f",
    "norms: output = column input": "#a6a6a6", "norms: rms": "#d0d0d0",
    "qkv output (q, k, v)": "#08519c", "rotated q": "#3182bd", "rotated k": "#6baed6",
    "attention output = proj input": "#9ecae1", "attention log-sum-exp": "#c6dbef",
    "fc1 output = GELU input": "#e6550d", "GELU output = fc2 input": "#fdae6b"}


def _tensor_kind(label):
    """Both norms' tensors of one kind as one, so that a bar has one segment per kind."""
    for norm, column in (("attn_norm ", "qkv"), ("mlp_norm ", "fc1")):
        if label.startswith(norm):
            return "norms: " + label[len(norm):].replace(f"= {column} input", "= column input")
    return label


@styled
def draw_memory_per_tensor(path):
    """What one block keeps for backward, per rank, at the profile's default shape: one device,
    TP alone and TP + SP at p = 2 and 4, each bar split per saved tensor (memory_model.py)."""
    shape = memory_model.profile_shape()
    setups = [("one device", 1, True), ("TP alone\np = 2", 2, False), ("TP + SP\np = 2", 2, True),
              ("TP alone\np = 4", 4, False), ("TP + SP\np = 4", 4, True)]
    fig = plt.figure(figsize=(WIDTH_IN, 4.8))
    ax = fig.add_axes((0.08, 0.13, 0.5, 0.74))
    for i, (name, p, sequence_parallel) in enumerate(setups):
        rows = memory_model.block_saved_elements(**shape | {"p": p},
                                                 sequence_parallel=sequence_parallel)
        mib = {}
        for label, region, n in rows:
            kind = _tensor_kind(label)
            mib[kind] = (mib.get(kind, (0, region))[0] + 4 * n / memory_model.MiB, region)
        bottom = 0.0
        for kind, (size, region) in mib.items():
            ax.bar(i, size, bottom=bottom, width=0.62, color=TENSOR_COLORS[kind],
                   edgecolor="white", linewidth=0.5,
                   hatch="//" if region == memory_model.REPLICATED else None)
            bottom += size
        ax.annotate(f"{bottom:.2f}", (i, bottom), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8.5, weight="bold")
    ax.set_xticks(range(len(setups)), [name for name, _, _ in setups], fontsize=8.5)
    ax.set_ylabel("MiB per rank, one block (fp32)")
    ax.margins(y=0.1)
    ax.spines[["top", "right"]].set_visible(False)
    fig.text(0.01, 0.955, "Activations one block keeps for backward, per rank", fontsize=11,
             weight="bold", va="center")
    fig.text(0.01, 0.905, "s = {s}, b = {b}, h = {h}, m = {f}, a = {a} (the profile's default "
             "shape); each segment one kind of saved tensor".format(**shape), fontsize=8.5,
             va="center")
    # Top to bottom as in the bars, then the hatching.
    handles = [Patch(facecolor=color, label=kind)
               for kind, color in reversed(TENSOR_COLORS.items())]
    handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="//",
                         label="full size on every rank under\nTP alone: does not shrink with p"))
    fig.legend(handles=handles, loc="center left",
               bbox_to_anchor=(0.6, 0.5), fontsize=8, frameon=False)
    save(fig, path)


# -- all of them, and whether they are current --------------------------------------------------
DRAWERS = {"column_row_split.png": draw_column_row_split, "collectives.png": draw_collectives,
           "transposes.png": draw_transposes,
           "regions.png": draw_regions, "ring_all_gather_gemm.png": draw_ring_all_gather_gemm,
           "ring_reduce_scatter.png": draw_ring_reduce_scatter,
           "ring_pieces.png": draw_ring_pieces,
           "memory_per_tensor.png": draw_memory_per_tensor,
           "halves_mirror.png": draw_halves_mirror, "ceiling_vs_limit.png": draw_ceiling_vs_limit}


def draw_all(out_dir):
    """Draw every figure into `out_dir` (created if needed); returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    return [draw(os.path.join(out_dir, name)) for name, draw in DRAWERS.items()]


def drawn_from(path):
    """The `Source-SHA256` a PNG was drawn from, or None if it has none or is no PNG."""
    from PIL import Image  # matplotlib's own dependency; only needed here

    try:
        with Image.open(path) as image:
            return getattr(image, "text", {}).get(SOURCE_KEY)
    except (OSError, SyntaxError, ValueError):  # unreadable or not an image at all
        return None


def stale_figures(out_dir):
    """One line per figure of `DRAWERS` missing from `out_dir` or drawn from other source."""
    current, lines = source_hash(), []
    for name in DRAWERS:
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            lines.append(f"{name}: missing")
        elif drawn_from(path) != current:
            lines.append(f"{name}: drawn from source {drawn_from(path)}, not the current "
                         f"{current[:12]}...")
    return lines


if __name__ == "__main__":
    for written in draw_all(sys.argv[1] if len(sys.argv) > 1 else os.path.join("blog", "figures")):
        print(written)
