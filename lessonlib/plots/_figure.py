"""What every figure shares: its set-up, the provenance footnote, the colours of the implementations, log ticks."""

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


def figure(ax=None, figsize=(7.5, 4.2)):
    """(fig, ax): ``ax``'s figure when the caller gives an axis, else a new figure of ``figsize``."""
    return (ax.figure, ax) if ax is not None else plt.subplots(figsize=figsize)


def finish(fig, footnote: str | None = None, bottom: float = 0.05):
    """Lay the figure out; a ``footnote`` (a recorded run's provenance, the ceilings' source) sits in a strip of
    height ``bottom`` under the axes, so a figure shown on a laptop never passes for a live measurement."""
    if footnote is None:
        fig.tight_layout()
        return fig
    fig.text(0.01, 0.005, footnote, fontsize=8, color="#555555", ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, bottom, 1, 1))
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


def shape_text(shape: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items())
