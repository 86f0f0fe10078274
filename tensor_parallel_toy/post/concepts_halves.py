"""The blog's figures of the two halves (halves/): their forward schedule and the backward
autograd makes of it by running the nodes in reverse, and what the rings can hide in one block
against what any schedule could."""
from matplotlib.patches import Rectangle

from .sketch import COMM, FULL, RANK_EDGE, RANK_FILL, canvas, save, styled

HALF_FILL = {"A": RANK_FILL[0], "B": RANK_FILL[2]}
HALF_EDGE = {"A": RANK_EDGE[0], "B": RANK_EDGE[2]}
CONJUGATE = {"AG": "RS", "RS": "AG"}
MIRROR = {"post": "wait", "wait": "post"}

# One block's first turns, as schedule.py's docstring lists them (block_in_halves): the half,
# and what it does in its turn, in order; "post X" ends a turn, "wait X" starts one.
FORWARD_TURNS = (
    ("A", ("norm", "post AG")),
    ("A", ("wait AG", "qkv GEMM")),
    ("B", ("norm", "post AG")),
    ("A", ("attend", "proj GEMM", "post RS")),
    ("B", ("wait AG", "qkv GEMM")),
    ("A", ("wait RS", "add", "norm", "post AG")),
    ("B", ("attend", "proj GEMM", "post RS")),
    ("A", ("wait AG", "fc1 GEMM", "gelu")),
)


def _phase(line):
    """"post AG" -> ("post", "AG"); an op -> (None, the op)."""
    verb, _, what = line.partition(" ")
    return (verb, what) if verb in MIRROR else (None, line)


def mirrored(turns):
    """The backward autograd runs for `turns`: the turns in reverse order, each one's lines
    reversed, every post a wait and every wait a post, of the conjugate collective."""
    backward = []
    for half, lines in reversed(turns):
        out = []
        for line in reversed(lines):
            verb, what = _phase(line)
            out.append(f"{MIRROR[verb]} {CONJUGATE[what]}" if verb else f"{what} bwd")
        backward.append((half, tuple(out)))
    return backward


def transfers(turns):
    """(half, kind, posted in turn i, waited for in turn j) per transfer; i or j is None where
    it lies outside `turns`. A half's post is waited for at the start of its next turn."""
    found, waited = [], set()
    for i, (half, lines) in enumerate(turns):
        verb, kind = _phase(lines[-1])
        if verb != "post":
            continue
        j = next((j for j in range(i + 1, len(turns)) if turns[j][0] == half), None)
        if j is not None:
            assert _phase(turns[j][1][0]) == ("wait", kind), (turns[i], turns[j])
            waited.add(j)
        found.append((half, kind, i, j))
    for j, (half, lines) in enumerate(turns):
        verb, kind = _phase(lines[0])
        if verb == "wait" and j not in waited:
            found.append((half, kind, None, j))
    return found


def _slots(turns, x0, turn_w, gap_w, space):
    """x of each turn's left edge, and of each idle gap: one where a half waits at the start
    of the turn after its own post, with no other turn between (nothing to hide it under)."""
    idle_after = {i for _, _, i, j in transfers(turns) if i is not None and j == i + 1}
    xs, gaps, x = [], [], x0
    for i in range(len(turns)):
        xs.append(x)
        x += turn_w + space
        if i in idle_after:
            gaps.append(x)
            x += gap_w + space
    return xs, gaps, x - space


def _marker(ax, x, y, verb, half):
    ax.plot([x], [y], marker="v" if verb == "post" else "^", markersize=6.5,
            color=HALF_EDGE[half], markeredgecolor=HALF_EDGE[half],
            markerfacecolor=HALF_EDGE[half] if verb == "post" else "white")


def _schedule(ax, turns, top, x0, end, prime, exposed):
    """One panel: the turns on a compute lane, the transfers under them on a wire lane.
    Returns (x centre of each turn, x centre of each idle gap, the wire lane's bottom)."""
    turn_w, gap_w, space, box_h, wire_h = 1.95, 0.8, 0.06, 1.5, 0.5
    xs, gaps, right = _slots(turns, x0, turn_w, gap_w, space)
    lane_y, wire_y = top - box_h, top - box_h - 0.45 - wire_h
    for i, ((half, lines), x) in enumerate(zip(turns, xs)):
        number = len(turns) - i if prime else i + 1
        ax.text(x + turn_w / 2, top + 0.22, f"{number}{'′' if prime else ''} · {half}",
                ha="center", va="center", fontsize=8, color=HALF_EDGE[half], weight="bold")
        ax.add_patch(Rectangle((x, lane_y), turn_w, box_h, facecolor=HALF_FILL[half],
                               edgecolor=HALF_EDGE[half], linewidth=1))
        ax.text(x + turn_w / 2, lane_y + box_h / 2, "\n".join(lines), ha="center",
                va="center", fontsize=7.5 if max(map(len, lines)) < 12 else 7, linespacing=1.25)
        for verb, at in ((_phase(lines[0])[0], x + 0.16),
                         (_phase(lines[-1])[0], x + turn_w - 0.16)):
            if verb:
                _marker(ax, at, lane_y - 0.22, verb, half)
    for g in gaps:
        ax.add_patch(Rectangle((g, lane_y), gap_w, box_h, facecolor="white",
                               edgecolor="#777777", linewidth=0.8, hatch="///"))
        ax.text(g + gap_w / 2, lane_y + box_h / 2, "idle", ha="center", va="center",
                fontsize=7.5, backgroundcolor="white")
    for half, kind, i, j in transfers(turns):
        start = x0 - 0.45 if i is None else xs[i] + turn_w
        stop = end if j is None else xs[j]
        ax.add_patch(Rectangle((start, wire_y), stop - start, wire_h, facecolor=COMM,
                               edgecolor=HALF_EDGE[half], linewidth=1.2))
        ax.text((start + stop) / 2, wire_y + wire_h / 2, f"{kind}({half})", ha="center",
                va="center", fontsize=7.5)
        if i is not None and j == i + 1:  # in an idle gap
            ax.text((start + stop) / 2, wire_y - 0.3, exposed, ha="center", va="center",
                    fontsize=7.5, color="#b2182b")
    for y, text in ((lane_y + box_h / 2, "compute"), (wire_y + wire_h / 2, "on the wire")):
        ax.text(0.3, y, text, va="center", fontsize=8.5, color="#555555")
    if prime:  # the backward of the turns after these ran before them
        ax.text(x0 - 0.08, lane_y + box_h / 2, "…", fontsize=11, ha="right", va="center")
    else:
        ax.text(right + 0.12, lane_y + box_h / 2, "…", fontsize=11, va="center")
    return [x + turn_w / 2 for x in xs], [g + gap_w / 2 for g in gaps], wire_y


@styled
def draw_halves_mirror(path):
    """The first turns of one block's forward in halves (schedule.py): A and B compute in
    turns, each half's transfer on the wire while the other half computes; below, the backward
    autograd runs: the same turns reversed in time, every post a wait and every wait a post,
    every all-gather a reduce-scatter and every reduce-scatter an all-gather."""
    fig, ax = canvas(20, 12.6)
    x0, end = 2.45, 19.4
    backward = mirrored(FORWARD_TURNS)
    ax.text(0.3, 12.15, "The two halves' forward schedule (one block, schedule.py), and "
            "autograd's mirror of it", fontsize=10.5, weight="bold", va="center")
    legend = [(HALF_FILL["A"], HALF_EDGE["A"], "half A's turn"),
              (HALF_FILL["B"], HALF_EDGE["B"], "half B's turn"),
              (COMM, "#a65d00", "a transfer on the wire (AG all-gather, RS reduce-scatter)")]
    x = 0.3
    for fill, edge, text in legend:
        ax.add_patch(Rectangle((x, 11.48), 0.45, 0.3, facecolor=fill, edgecolor=edge))
        ax.text(x + 0.6, 11.63, text, fontsize=8.5, va="center")
        x += 1.0 + 0.135 * len(text)
    for verb, text, at in (("post", "post: starts a transfer", 0.52),
                           ("wait", "wait: blocks until the transfer is done", 4.9)):
        _marker(ax, at, 11.05, verb, "A")
        ax.text(at + 0.3, 11.05, text, fontsize=8.5, va="center")

    top_f, top_b = 9.95, 5.4
    ax.text(0.3, top_f + 0.22, "forward", fontsize=10, weight="bold", va="center")
    fwd_x, fwd_gaps, fwd_bottom = _schedule(ax, FORWARD_TURNS, top_f, x0, end, False,
                                            "exposed: the pipeline's fill")
    ax.text(0.3, top_b + 0.22, "backward,", fontsize=10, weight="bold", va="center")
    ax.text(0.3, top_b - 0.2, "by autograd", fontsize=9, va="center")
    bwd_x, bwd_gaps, bwd_bottom = _schedule(ax, backward, top_b, x0, end, True,
                                            "exposed: the mirror of the fill")
    # Forward turn k and its backward k′, the turns in reverse order: thin lines between them.
    for a, b in zip(fwd_x + fwd_gaps, list(reversed(bwd_x)) + list(reversed(bwd_gaps))):
        ax.plot([a, b], [fwd_bottom - 0.6, top_b + 0.5], color="#bbbbbb", linewidth=0.7,
                zorder=0)
    middle = (fwd_x[0] + bwd_x[-1]) / 2, (fwd_bottom - 0.1 + top_b) / 2
    ax.text(*middle, "turn k ↔ its backward k′", ha="center", va="center", fontsize=8,
            color="#555555", backgroundcolor="white")

    n = len(FORWARD_TURNS)
    ax.text(0.3, bwd_bottom - 0.9, "No backward schedule is written: autograd runs nodes in "
            "reverse creation order", fontsize=10, weight="bold", va="center")
    ax.text(0.3, bwd_bottom - 1.45, f"k′: the backward of forward turn k, run (N + 1 − k)-th of "
            f"the N = {n} shown. Each collective is two nodes: a wait node's backward posts",
            fontsize=8.5, va="center")
    ax.text(0.3, bwd_bottom - 1.85, "the conjugate collective (AG ↔ RS), the post node's "
            "backward waits for it; so each backward transfer runs under the backward of",
            fontsize=8.5, va="center")
    ax.text(0.3, bwd_bottom - 2.25, "the turn that hid its forward (split_phase.py). "
            "Turns of equal width: durations are not to scale.", fontsize=8.5, va="center")
    save(fig, path)


# -- what the rings can hide, and what any schedule could ---------------------------------------
GEMM_FILL = RANK_FILL[0]
# One block's forward on one rank, in order, illustrative durations: compute with no transfer
# beside it as (name, time); a layer as (name, its collective, transfer time, GEMM time). The
# four transfers move the same bytes; the attention's layers are narrow (transfer > GEMM), the
# MLP's wide (transfer < GEMM).
BLOCK = (("norm", 0.8), ("qkv", "AG", 3.5, 3.0), ("attend", 3.0), ("proj", "RS", 3.5, 1.0),
         ("add, norm", 1.2), ("fc1", "AG", 3.5, 4.5), ("gelu", 0.8), ("fc2", "RS", 3.5, 4.5),
         ("add", 0.4))


def _bars(block):
    """{bar: (compute spans, transfer spans)}, a span (start, end, kind, label), kind "gemm",
    "other" or "wait": the basic layers (every transfer waited for), the rings (a transfer
    under its own layer's GEMM at best), the limit (every transfer under some compute)."""
    bars = {}
    for bar in ("tp", "rings", "limit"):
        spans, wire, t = [], [], 0.0
        for item in block:
            if len(item) == 2:
                spans.append((t, t + item[1], "other", item[0]))
                t += item[1]
                continue
            name, kind, comm, gemm = item
            if bar == "tp":
                first, second = ("wait", f"wait {kind}", comm), ("gemm", name, gemm)
                for what, label, time in ((first, second) if kind == "AG" else (second, first)):
                    spans.append((t, t + time, what, label))
                    if what == "wait":
                        wire.append((t, t + time, kind))
                    t += time
                continue
            spans.append((t, t + gemm, "gemm", name))
            if bar == "rings":
                wire.append((t, t + comm, kind))
                if comm > gemm:
                    spans.append((t + gemm, t + comm, "wait", "wait"))
                t += max(comm, gemm)
            else:
                t += gemm
        if bar == "limit":  # the transfers, one after another, under the compute
            start = 0.0
            for _, kind, comm, _ in (item for item in block if len(item) == 4):
                wire.append((start, start + comm, kind))
                start += comm
        bars[bar] = spans, wire
    return bars


def budget(block):
    """{tp, rings, limit}: the block's length under each, from the durations alone."""
    layers = [item for item in block if len(item) == 4]
    comm = sum(c for _, _, c, _ in layers)
    compute = sum(g for _, _, _, g in layers) + sum(t for item in block if len(item) == 2
                                                    for t in item[1:])
    return {"tp": comm + compute, "rings": comm + compute - sum(min(c, g) for *_, c, g in layers),
            "limit": max(comm, compute)}


def _bar(ax, y, spans, wire, scale, x0):
    """Compute spans at y, transfers on a thin strip beneath; a label that does not fit in its
    span goes above it, one level higher when it would touch the previous one."""
    fills = {"gemm": GEMM_FILL, "other": FULL, "wait": "white"}
    h, strip, last_right = 0.75, 0.3, -1.0
    for start, end, kind, label in spans:
        x, w = x0 + start * scale, (end - start) * scale
        ax.add_patch(Rectangle((x, y), w, h, facecolor=fills[kind], edgecolor="#555555",
                               linewidth=0.8, hatch="///" if kind == "wait" else None))
        width = 0.14 * len(label)
        if width < w - 0.08:
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=7.5,
                    backgroundcolor="white" if kind == "wait" else "none")
        elif kind != "wait":
            level = 1 if x + w / 2 - width / 2 < last_right + 0.1 else 0
            top = y + h + 0.2 + 0.3 * level
            if level:
                ax.plot([x + w / 2] * 2, [y + h, top - 0.12], color="#777777", linewidth=0.6)
            ax.text(x + w / 2, top, label, ha="center", va="center", fontsize=7)
            last_right = x + w / 2 + width / 2
    for start, end, kind in wire:
        ax.add_patch(Rectangle((x0 + start * scale, y - 0.08 - strip), (end - start) * scale,
                               strip, facecolor=COMM, edgecolor="#a65d00", linewidth=0.8))
        ax.text(x0 + (start + end) / 2 * scale, y - 0.08 - strip / 2, kind, ha="center",
                va="center", fontsize=6.5)
    return x0 + spans[-1][1] * scale


@styled
def draw_ceiling_vs_limit(path):
    """One block's forward on one rank, on one time axis: the basic layers wait for every
    transfer; the rings hide each transfer under its own layer's GEMM at best, so a transfer
    longer than its GEMM still shows; any schedule at all could hide every transfer under the
    block's compute: max(comm, compute). Durations illustrative."""
    fig, ax = canvas(20, 10.4)
    x0, right = 3.5, 17.6
    lengths, bars = budget(BLOCK), _bars(BLOCK)
    scale = (right - x0) / lengths["tp"]
    ax.text(0.3, 9.95, "One block's forward on one rank: what the rings can hide, against what "
            "any schedule could", fontsize=10.5, weight="bold", va="center")
    ax.text(0.3, 9.45, "Durations illustrative. The four transfers move the same bytes; "
            "attention's GEMMs are shorter than theirs, the MLP's longer.", fontsize=8.5,
            va="center")
    legend = [(GEMM_FILL, None, "a layer's GEMM"),
              (FULL, None, "other compute (norms, attend, GELU, adds)"),
              ("white", "///", "waiting for a transfer"), (COMM, None, "a transfer on the wire")]
    x = 0.3
    for fill, hatch, text in legend:
        ax.add_patch(Rectangle((x, 8.78), 0.45, 0.3, facecolor=fill, hatch=hatch,
                               edgecolor="#a65d00" if fill == COMM else "#555555"))
        ax.text(x + 0.6, 8.93, text, fontsize=8.5, va="center")
        x += 1.0 + 0.15 * len(text)
    rows = [("tp", "tp", "(basic layers)",
             r"every transfer waited for:  tp = $\Sigma\,$comm + $\Sigma\,$compute"),
            ("rings", "rings", "(tp_overlap)",
             r"rings' ceiling = block $-\ \Sigma_{\mathrm{layers}}\ \min(\mathrm{comm}_l,\ "
             r"\mathrm{GEMM}_l)$: a transfer hides only under its own layer's GEMM"),
            ("limit", "the limit of", "any schedule",
             r"limit = $\max(\Sigma\,\mathrm{comm},\ \Sigma\,\mathrm{compute})$: every "
             r"transfer under some compute, attention's and the norms' included")]
    top, pitch, ends = 7.25, 2.45, []
    for i, (bar, name, second, formula) in enumerate(rows):
        y = top - i * pitch
        ax.text(0.3, y + 0.5, name, fontsize=9.5, weight="bold", va="center")
        ax.text(0.3, y + 0.08, second, fontsize=8.5, va="center")
        end = _bar(ax, y, *bars[bar], scale, x0)
        assert abs(end - (x0 + lengths[bar] * scale)) < 1e-9, (bar, end)
        ax.text(x0, y - 0.75, formula, fontsize=8.5, va="center")
        ax.text(end + 0.12, y + 0.375, f"{lengths[bar] / lengths['tp']:.2f} × tp",
                fontsize=9, weight="bold", va="center", backgroundcolor="white")
        ends.append(end)
    for end in ends:
        ax.plot([end, end], [top - 2 * pitch - 0.45, top + 0.8], color="#555555",
                linewidth=0.8, linestyle="--", zorder=0)
    ax.text(0.3, 0.75, "Between the rings and the limit: what a narrow layer's transfer has "
            "beyond its GEMM. Only compute from outside", fontsize=8.5, va="center")
    ax.text(0.3, 0.33, "the layer can hide it (attend, the norms, or the other half of the "
            "batch, as tp_halves does).", fontsize=8.5, va="center")
    save(fig, path)
