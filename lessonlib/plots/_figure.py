"""What every figure shares: its set-up and size, the provenance footnote, the colours of the implementations, log
and integer ticks."""

from __future__ import annotations

import matplotlib.pyplot as plt

from lessonlib.results import Impl

IMPL_COLORS = {  # one colour per implementation, in every figure
    Impl.EAGER: "#d62728",
    Impl.COMPILE: "#1f77b4",
    Impl.LESSONLIB: "#2ca02c",
    Impl.COPY: "#7f7f7f",
    # attention's peers (the colours they had when picked by sorted name: C3, C4, C5, C7)
    Impl.SDPA_CUDNN: "#d62728",
    Impl.SDPA_EFFICIENT: "#9467bd",
    Impl.SDPA_FLASH: "#8c564b",
    Impl.NAIVE: "#7f7f7f",
    Impl.SDPA: "#e377c2",
    Impl.EAGER_ATTENTION: "#ff7f0e",
    # lesson 07's peers (matplotlib's first four colours, the order the engine benchmark records them in)
    Impl.HF_DYNAMIC: "#1f77b4",
    Impl.HF_STATIC: "#ff7f0e",
    Impl.ENGINE_GRAPHS: "#2ca02c",
    Impl.ENGINE_EAGER: "#d62728",
    Impl.ENGINE_GRAPHS_CUBLAS: "#98df8a",  # the engine's light green: the same engine, cuBLAS for its projections
    Impl.ENGINE_GRAPHS_SYNC: "#bcbd22",  # olive: the same engine, the host waiting for each step's tokens
    Impl.ENGINE_FUSED_DECODE: "#006d2c",  # the engine's dark green: the same engine, six kernels per batch-1 layer
}


# The size a figure is drawn at is the size it is read at. JupyterLab in a 1280x800 window, its file browser open,
# gives a cell's output OUTPUT_PX = 848 pixels (measured in Chromium, JupyterLab 4.6); an image wider than that is
# scaled down to fit, and a 13-inch figure's 8-point legend came out at 3.5 px. The notebook saves figures at
# matplotlib's default 100 dpi with bbox_inches="tight", which pads 0.1 inch on each side: a figure WIDTH = 8.2
# inches wide is an 840-pixel image, shown whole. Text is at least MIN_FONT = 7 points: 9.7 px at 100 dpi.
OUTPUT_PX = 848
WIDTH = 8.2
MIN_FONT = 7


def figure(ax=None, figsize=(7.5, 4.2)):
    """(fig, ax): ``ax``'s figure when the caller gives an axis, else a new figure of ``figsize``."""
    return (ax.figure, ax) if ax is not None else plt.subplots(figsize=figsize)


def finish(fig, footnote: str | None = None, bottom: float = 0.05):
    """Lay the figure out; a ``footnote`` (a recorded run's provenance, the ceilings' source) sits in a strip of
    height ``bottom`` under the axes, so a figure shown on a laptop never passes for a live measurement. The figure
    is then made readable where it is shown (:func:`fit`)."""
    if footnote is not None:
        fig.text(0.01, 0.005, footnote, fontsize=8, color="#555555", ha="left", va="bottom", wrap=True)
    return fit(fig, rect=(0, bottom if footnote is not None else 0, 1, 1))


def shown_px(fig) -> float:
    """The width in pixels of the image a notebook shows for ``fig``: its tight bounding box (legends and labels
    outside the axes included) plus savefig's padding, at the figure's dpi."""
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    return (box.width + 2 * plt.rcParams["savefig.pad_inches"]) * fig.dpi


def fit(fig, rect=(0, 0, 1, 1)):
    """No text under MIN_FONT points, and the figure no wider than a JupyterLab output at 1280 px (OUTPUT_PX): a
    wider figure is narrowed (its height kept) and laid out again, so it is shown at its natural size."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < MIN_FONT:
            text.set_fontsize(MIN_FONT)
    for _ in range(4):  # narrowing re-wraps labels and footnotes: measure again
        fig.tight_layout(rect=rect)
        over = shown_px(fig) - OUTPUT_PX
        if over <= 0:
            break
        width, height = fig.get_size_inches()
        fig.set_size_inches(width - over / fig.dpi - 0.05, height)
    return fig


def plain_log_ticks(ax) -> None:
    """Label log axes 0.01 … 1000 in plain text. The default labels (10^k) go through matplotlib's mathtext parser,
    which is not safe to call from two threads at once, and a widget callback in JupyterLab may run on a kernel
    subshell's thread (seen as an intermittent "ParseException: Expected end of text" on a slider move).
    An axis spanning less than two decades shows one power of ten or none: it is labelled at 1, 2 and 5 times each
    (lesson 01's per-call times, 14 to 290 µs, had "100" as their only label). Call it after drawing."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        if axis.get_scale() == "log":
            low, high = sorted(limits)
            if low > 0 and math.log10(high / low) < 2:
                axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(NullFormatter())


def integer_ticks(ax, axis: str = "both") -> None:
    """Tick an axis whose values are whole numbers (columns, counts, block ids) at integers only, labelled without
    decimals ("0, 2, 4", not "0.0, 2.5, 5.0"). ``axis``: "x", "y" or "both"."""
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator

    for name in ("x", "y") if axis == "both" else (axis,):
        target = ax.xaxis if name == "x" else ax.yaxis
        target.set_major_locator(MaxNLocator(integer=True))
        target.set_major_formatter(FormatStrFormatter("%d"))


def shape_text(shape: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items())
