"""Lessons 02-05's recorded run beside the student's GPU (:mod:`lessonlib.widgets.recorded`): one panel per field,
each implementation's recorded bar with, where measured, this GPU's hatched bar beside it."""

from __future__ import annotations

import textwrap

import numpy as np

from lessonlib.plots._figure import IMPL_COLORS, finish
from lessonlib.plots.fusion import gpu_name
from lessonlib.results import Unit

SPEEDUP = "speedup"  # not a record field: the baseline's time over the implementation's
FIELD_LABELS = {Unit.TFLOPS: "TFLOP/s", Unit.GBPS: "GB/s from Python",
                Unit.GRAPH_GBPS: "GB/s in a CUDA graph", Unit.US: "µs per call",
                SPEEDUP: "speedup over eager", "launches": "kernel launches per step"}
_OTHER_COLORS = ("#17becf", "#bcbd22", "#ff7f0e", "#e377c2")


def recorded_vs_live(recorded: dict, live: dict | None, fields, title: str, recorded_gpu: str, provenance: str):
    """``recorded`` and ``live``: {impl: {field: value or None}}; a None value (the case failed there) has no bar."""
    import matplotlib.pyplot as plt

    impls = list(recorded) + [i for i in (live or {}) if i not in recorded]
    panel_width = max(6.5, 1.35 * len(impls))
    fig, axes = plt.subplots(1, len(fields), figsize=(panel_width * len(fields), 4.2), squeeze=False)
    colors = {i: IMPL_COLORS.get(i, _OTHER_COLORS[n % len(_OTHER_COLORS)]) for n, i in enumerate(impls)}
    sources = [(f"recorded, {recorded_gpu}", recorded, None)]
    if live is not None:
        sources.append((f"measured now, {gpu_name()}", live, "//"))
    width = 0.8 / len(sources)
    for ax, field in zip(axes[0], fields):
        for s, (label, values, hatch) in enumerate(sources):
            xs = np.arange(len(impls)) + (s - (len(sources) - 1) / 2) * width
            heights = [(values.get(i) or {}).get(field) for i in impls]
            bars = ax.bar(xs, [h or 0 for h in heights], width=width * 0.95, hatch=hatch, label=label,
                          color=[colors[i] for i in impls], edgecolor="white" if hatch else None)
            for bar, h in zip(bars, heights):
                text = "-" if h is None else f"{h:,.2f}x" if field == SPEEDUP else _number(h)
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(range(len(impls)), [textwrap.fill(i, 16) for i in impls], fontsize=8)
        ax.set_ylabel(FIELD_LABELS[field])
        if len(sources) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return finish(fig, provenance, bottom=0.08)


def _number(value: float) -> str:
    """3,823 rather than 3.82e+03; three significant digits below 100."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
