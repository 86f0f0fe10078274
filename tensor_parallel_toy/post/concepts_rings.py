"""The blog's figures of the rings: the ring all-gather + GEMM of the column layer's forward and
the ring reduce-scatter of the row layer's, step by step on four ranks, each with one rank's
timeline; they follow `ring_all_gather` and `ring_reduce_scatter` in ring.py. And one rank's
timeline with each chunk sent whole or in pieces (part 2's bounds 2 and 3), from
`piece_schedule`, which runs `ring_all_gather`'s loop on a clock."""
from matplotlib.patches import Rectangle

from .sketch import COMM, FULL, RANK_EDGE, RANK_FILL, arrow, canvas, save, styled


def _ring_grid(ax, p, top, cell, send_label):
    """Ranks (rows, rank 0 on top) by steps (columns). cell(r, k) -> (text, chunk, last):
    the cell is coloured as the chunk, bold-edged when `last`. An arrow from (r, k) to
    (r+1, k+1): what rank r holds at step k travels to rank r+1, which uses it at step k+1
    (`send_label(r, k)` names it)."""
    col_w, cell_w, row_h, cell_h, x0 = 4.3, 3.1, 1.55, 1.1, 2.0

    def corner(r, k):
        return x0 + k * col_w, top - (r + 1) * row_h + (row_h - cell_h)

    for k in range(p):
        ax.text(x0 + k * col_w + cell_w / 2, top + 0.3, f"step k = {k}", ha="center",
                va="center", weight="bold")
    for r in range(p):
        ax.text(x0 - 0.2, corner(r, 0)[1] + cell_h / 2, f"rank {r}", ha="right", va="center")
        for k in range(p):
            text, chunk, last = cell(r, k)
            x, y = corner(r, k)
            ax.add_patch(Rectangle((x, y), cell_w, cell_h, facecolor=RANK_FILL[chunk],
                                   edgecolor="black" if last else RANK_EDGE[chunk],
                                   linewidth=2.2 if last else 1))
            ax.text(x + cell_w / 2, y + cell_h / 2, text, ha="center", va="center", fontsize=8.5)
            if k == p - 1:
                continue
            label = send_label(r, k)
            if r < p - 1:  # to the next rank, used there one step later
                nx, ny = corner(r + 1, k + 1)
                arrow(ax, (x + cell_w, y + 0.15), (nx, ny + cell_h - 0.15), RANK_EDGE[chunk])
                ax.text(x + cell_w + 0.05, y - 0.08, label, fontsize=7.5, va="top",
                        color=RANK_EDGE[chunk])
            else:  # the last rank's chunk wraps around to rank 0
                arrow(ax, (x + cell_w, y + 0.15), (x + cell_w + 0.6, y - 0.35),
                       RANK_EDGE[chunk])
                ax.text(x + cell_w + 0.65, y - 0.35, f"{label} to rank 0", fontsize=7.5,
                        va="center", color=RANK_EDGE[chunk])
                nx, ny = corner(0, k + 1)
                arrow(ax, (nx - 0.6, ny + cell_h + 0.45), (nx, ny + cell_h - 0.15),
                       RANK_EDGE[chunk])
    return top - p * row_h


def _timeline(ax, y, label, spans, scale, x0=3.3):
    """One timeline row: spans of (start, end, text, fill, hatched) in time units."""
    ax.text(x0 - 0.2, y + 0.35, label, ha="right", va="center", fontsize=8.5)
    for start, end, text, fill, hatched in spans:
        ax.add_patch(Rectangle((x0 + start * scale, y), (end - start) * scale, 0.7,
                               facecolor=fill, edgecolor="#555555", linewidth=0.8,
                               hatch="///" if hatched else None))
        ax.text(x0 + (start + end) / 2 * scale, y + 0.35, text, ha="center", va="center",
                fontsize=7.5)


@styled
def draw_ring_all_gather_gemm(path):
    """ring.py's `ring_all_gather` feeding the column layer's GEMM: at step k rank r holds
    chunk (r - k) mod p, multiplies it into its rows of Y, and passes it to rank r + 1 while
    the GEMM runs; below, rank 1's timeline, basic against ring."""
    p = 4
    fig, ax = canvas(20, 14.4)
    ax.text(0.3, 13.9, "All-gather + GEMM as a ring (column layer forward, p = 4): "
            "at step k, rank r holds chunk (r − k) mod p", fontsize=10, weight="bold",
            va="center")
    bottom = _ring_grid(
        ax, p, 12.9,
        lambda r, k: (f"holds $X_{(r - k) % p}$\nGEMM → Y chunk {(r - k) % p}",
                      (r - k) % p, False),
        lambda r, k: f"$X_{(r - k) % p}$")
    ax.text(0.3, bottom - 0.45, r"$X_c$: sequence chunk c, [s/p, b, h], which rank c starts "
            "with. The transfer of the next chunk is posted before the GEMM of this one, so "
            "it", fontsize=8.5, va="center")
    ax.text(0.3, bottom - 0.9, r"travels while the GEMM runs. Each GEMM writes its rows of "
            r"Y [s, b, out/p] in place (out=): the gathered X is never built.", fontsize=8.5,
            va="center")

    t_g, t_c, scale = 1.0, 0.8, 2.45  # one chunk's GEMM, one ring step's transfer (t_c < t_g)
    y = bottom - 2.6
    ax.text(0.3, y + 1.0, "Rank 1's timeline, with one ring step's transfer (t_c) shorter "
            "than one chunk's GEMM (t_g):", fontsize=9, va="center", weight="bold")
    gather = (p - 1) * t_c
    _timeline(ax, y - 0.1, "basic: compute", [
        (0, gather, "waiting", "white", True),
        (gather, gather + p * t_g, "GEMM on X0 X1 X2 X3 (the whole X)", FULL, False)], scale)
    _timeline(ax, y - 0.9, "network", [(0, gather, "all-gather X", COMM, False)], scale)
    order = [(1 - k) % p for k in range(p)]
    _timeline(ax, y - 2.2, "ring: compute", [
        (k * t_g, (k + 1) * t_g, f"GEMM X{c}", RANK_FILL[c], False)
        for k, c in enumerate(order)], scale)
    _timeline(ax, y - 3.0, "network", [
        (k * t_g, k * t_g + t_c, f"recv X{order[k + 1]} ◄ 0\nsend X{order[k]} ► 2", COMM,
         False)
        for k in range(p - 1)], scale)
    ax.text(3.3 + (gather + p * t_g) * scale + 0.1, y + 0.25, "done", fontsize=8, va="center")
    ax.text(3.3 + p * t_g * scale + 0.1, y - 1.85, "done", fontsize=8, va="center")
    ax.text(0.3, y - 3.75, r"Ring: $(p-1)\cdot\max(t_g, t_c) + t_g$, that is $\tau_g = p\,t_g$ "
            r"here (all communication hidden); basic: $\tau_c + \tau_g$.", fontsize=9,
            va="center")
    save(fig, path)


@styled
def draw_ring_reduce_scatter(path):
    """ring.py's `ring_reduce_scatter` of the row layer's partial sums: the running sum of
    chunk c starts on rank c + 1, travels right, gains each rank's partial, and arrives
    complete on rank c after p - 1 hops."""
    p = 4
    fig, ax = canvas(20, 12.0)
    ax.text(0.3, 11.5, "GEMM + reduce-scatter as a ring (row layer forward, p = 4): "
            "chunk c's running sum starts on rank c + 1", fontsize=10, weight="bold",
            va="center")

    def cell(r, k):
        c = (r - 1 - k) % p
        ranks = "+".join(str((r - j) % p) for j in range(k, -1, -1))
        done = k == p - 1
        first = f"own $P_{c}$" if k == 0 else f"received + own $P_{c}$"
        total = (f"$Y_{r} = \\Sigma_{c}$, all {p} ranks" if done
                 else f"$\\Sigma_{c}$ = ranks {ranks}")
        return first + "\n" + total, c, done

    bottom = _ring_grid(ax, p, 10.5, cell, lambda r, k: f"$\\Sigma_{(r - 1 - k) % p}$")
    ax.text(0.3, bottom - 0.45, r"$P_c$: this rank's partial sum of chunk c, [s/p, b, out], "
            r"computed just before it is needed;  $\Sigma_c$: the running sum of chunk c.",
            fontsize=8.5, va="center")
    ax.text(0.3, bottom - 0.9, "Each rank sends p − 1 chunks of N/p: (p − 1)/p · N, the "
            "traffic of one reduce-scatter, each transfer under the next partial GEMM.",
            fontsize=8.5, va="center")

    t_g, t_c, scale = 1.0, 0.8, 3.0
    y = bottom - 2.6
    ax.text(0.3, y + 1.0, "Rank 1's timeline (the first GEMM has nothing to hide under it):",
            fontsize=9, va="center", weight="bold")
    order = [(1 - 1 - k) % p for k in range(p)]
    _timeline(ax, y - 0.1, "compute", [
        (k * t_g, (k + 1) * t_g, f"P{c}" + (" + Σ → Y1" if k == p - 1 else ""),
         RANK_FILL[c], False) for k, c in enumerate(order)], scale)
    _timeline(ax, y - 0.9, "network", [
        (k * t_g, k * t_g + t_c, f"send Σ{order[k - 1]} ► 2\nrecv Σ{order[k]} ◄ 0", COMM,
         False)
        for k in range(1, p)], scale)
    save(fig, path)


def piece_schedule(p, pieces, tau_c, tau_g):
    """One rank's timeline in the all-gather ring + GEMM, chunks of equal cost and no latency,
    each chunk sent as `pieces` pieces, as `ring_all_gather`'s loop runs it: at step k, for
    each piece j, wait for it to arrive, post its transfer onward (it starts when the link is
    free), then run its GEMM. Every rank runs the same clock, so a piece arrives when its
    sender's transfer of it ends. Returns (spans, end): spans are (lane, start, end, step,
    piece), lane "transfer" or "GEMM"; `end`, the last GEMM's end, is section 2's `τ`."""
    transfer, gemm = tau_c / ((p - 1) * pieces), tau_g / (p * pieces)
    spans, now, link, arrives = [], 0.0, 0.0, {}
    for k in range(p):
        for j in range(pieces):
            now = max(now, arrives.get((k, j), 0.0))  # wait for the piece (own chunk: at once)
            if k < p - 1:  # post it onward: the next rank's piece j of step k + 1
                start = max(now, link)
                link = arrives[k + 1, j] = start + transfer
                spans.append(("transfer", start, link, k + 1, j))
            spans.append(("GEMM", now, now + gemm, k, j))
            now += gemm
    return spans, now


@styled
def draw_ring_pieces(path):
    """Rank 0's timeline at p = 2 with the chunk from rank 1 sent whole, then in two pieces,
    from `piece_schedule`: part 2's bounds 2 and 3 on a clock."""
    p, tau_g, tau_c, scale = 2, 8.0, 6.0, 1.45  # in units of τg/8: τc = 3/4 · τg
    fig, ax = canvas(20, 7.6)
    ax.text(0.3, 7.15, r"Rank 0 of p = 2, $\tau_c = 3/4 \cdot \tau_g$, in units of "
            r"$\tau_g/8$: rank 1's chunk sent whole (M = 1) or in M = 2 pieces",
            fontsize=10, weight="bold", va="center")
    x0 = 3.3
    for t in range(11):
        ax.text(x0 + t * scale, 6.45, str(t), ha="center", va="center", fontsize=8)
        ax.plot([x0 + t * scale] * 2, [1.3, 6.2], color="#dddddd", linewidth=0.6, zorder=0)
    for row, pieces in enumerate((1, 2)):
        spans, end = piece_schedule(p, pieces, tau_c, tau_g)
        y = 4.9 - row * 2.6
        name = (lambda k, j: ("o" if k == 0 else "x") + (str(j) if pieces > 1 else ""))
        for lane, dy in (("transfer", 0.0), ("GEMM", -0.9)):
            _timeline(ax, y + dy, f"M = {pieces}: {lane}s", [
                (start, stop, name(k, j), COMM if lane == "transfer" else RANK_FILL[k], False)
                for lane_, start, stop, k, j in spans if lane_ == lane], scale, x0)
        ax.text(x0 + end * scale + 0.2, y - 0.55, f"τ = {end:g}", fontsize=9, va="center")
    ax.text(0.3, 0.6, "o: the GEMM of rank 0's own chunk; x: the chunk from rank 1, its "
            "transfer, then its GEMM; pieces numbered.", fontsize=8.5, va="center")
    ax.text(0.3, 0.15, "M = 1: τ = τc + τg/2 = 10.   M = 2: only the last piece's GEMM, τg/4, "
            "has nothing beside it: τ = τc + τg/4 = 8 = τg.", fontsize=8.5, va="center")
    save(fig, path)
