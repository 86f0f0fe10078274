"""The kit the blog's conceptual figures are drawn with: one axis in square units covering the
whole figure, boxes, arrows, fixed fonts, and PNGs stamped with the hash of their source.

Each PNG carries a text chunk `Source-SHA256`, the hash of every file in FIGURE_SOURCES (this
kit, the figures, and memory_model.py, whose numbers one figure draws): concepts.stale_figures
names every figure drawn from other source, without looking at file times, which a fresh clone
does not keep. The drawing is deterministic: fixed fonts, no date or software version in the file.
"""
import functools
import hashlib
import os

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

from ..profiling.report.output import atomic_path  # noqa: E402

FIGURE_SOURCES = ("post/sketch.py", "post/concepts.py", "post/concepts_rings.py",
                  "post/concepts_halves.py", "profiling/measure/memory_model.py")  # in the package
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_KEY = "Source-SHA256"
WIDTH_IN, DPI = 8.2, 110  # about 900 pixels wide: the blog's column
RC = {"font.family": "DejaVu Sans", "mathtext.fontset": "dejavusans", "font.size": 9,
      "hatch.linewidth": 0.8}
RANK_FILL = ["#aec7e8", "#ffbb78", "#98df8a", "#ff9896"]  # rank (or chunk) r's colour
RANK_EDGE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
FULL, SUM, COMM = "#d9d9d9", "#d8c8f0", "#fdd0a2"  # a whole tensor, a finished sum, a transfer


def source_hash():
    """sha256 of the source the figures are drawn from: FIGURE_SOURCES, in order."""
    digest = hashlib.sha256()
    for name in FIGURE_SOURCES:
        with open(os.path.join(PACKAGE_DIR, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def canvas(width, height):
    fig = plt.figure(figsize=(WIDTH_IN, WIDTH_IN * height / width))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def box(ax, x, y, w, h, text="", fill=FULL, edge="#333333", size=8.5, dashed=False, **text_kw):
    """A rectangle with its lower-left corner at (x, y) and `text` at its centre."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=fill, edgecolor=edge, linewidth=1,
                           linestyle="--" if dashed else "-"))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, **text_kw)


def rounded(ax, x, y, w, h, text, fill=COMM, size=8.5, edge="#a65d00"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.25",
                                facecolor=fill, edgecolor=edge, linewidth=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def arrow(ax, start, end, color="#333333", width=1.2):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(
        arrowstyle="-|>", color=color, linewidth=width, shrinkA=1, shrinkB=1))


def save(fig, path):
    """PNG with the source hash and without a date or software version, so that the same
    source draws the same bytes."""
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=DPI,
                        metadata={"Software": None, SOURCE_KEY: source_hash()})
    finally:
        plt.close(fig)


def styled(draw):
    """Draw with the fixed fonts, whatever the caller's matplotlib settings; return the path."""
    @functools.wraps(draw)
    def run(path):
        with plt.rc_context(RC):
            draw(path)
        return path
    return run
