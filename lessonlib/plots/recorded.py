"""Lessons 02-05's recorded run beside the student's GPU (:mod:`lessonlib.widgets.recorded`): one panel per field,
each implementation's recorded bar with, where measured, this GPU's hatched bar under it.

Horizontal bars, so that the implementations' long names ("lessonlib, tables validated every call") read on one
line; a value the run has not (a peer that failed, a call a CUDA graph cannot hold) is drawn as a marker with the
reason, not as a bar of height zero that looks like a measurement."""

from __future__ import annotations

import textwrap

import numpy as np

from lessonlib.plots._figure import IMPL_COLORS, WIDTH, finish
from lessonlib.plots.fusion import gpu_name
from lessonlib.results import Impl, Unit

SPEEDUP = "speedup"  # not a record field: the baseline's time over the implementation's
FIELD_LABELS = {Unit.TFLOPS: "TFLOP/s", Unit.GBPS: "GB/s from Python",
                Unit.GRAPH_GBPS: "GB/s in a CUDA graph", Unit.US: "µs per call",
                SPEEDUP: "speedup over eager", "launches": "kernel launches per step"}
_OTHER_COLORS = ("#17becf", "#bcbd22", "#ff7f0e", "#e377c2")
# Lessons 03 and 05's implementations that IMPL_COLORS leaves out, one colour each in every figure of their lesson
# (the lesson's own plots take theirs from here too): in lesson 03 orange is FlexAttention's alone.
RUN_COLORS = {
    Impl.TABLES_VALIDATED: "#bcbd22", Impl.SLOTS_VALIDATED: "#dbdb8d",  # lessonlib with host-side checks: olive
    Impl.SDPA_CONTIGUOUS: IMPL_COLORS[Impl.COMPILE], Impl.GATHER_THEN_SDPA: "#9ecae1", Impl.FLEX_PAGED: "#ff7f0e",
    Impl.APPLY_ROPE_THEN_STORE_KV: "#e377c2", Impl.COPIES_APPLY_ROPE_STORE_KV: "#f7b6d2",
    Impl.EAGER_STEP: IMPL_COLORS[Impl.EAGER], Impl.FUSED_STEP: IMPL_COLORS[Impl.LESSONLIB],
    Impl.FUSED_STEP_GRAPH: "#6a3d9a", Impl.CUDA_GRAPH_BY_HAND: "#6a3d9a", Impl.COMPILE_REDUCE_OVERHEAD: "#17becf",
}
MISSING_COLOR = "#b2182b"
FONT = 10  # points: 14 pixels at the 100 dpi a notebook shows the figure at (_figure.py)


def recorded_vs_live(recorded: dict, live: dict | None, fields, title: str, recorded_gpu: str, provenance: str,
                     missing: dict | None = None):
    """``recorded`` and ``live``: {impl: {field: value or None}}; ``missing``: {"recorded" or "live": {impl:
    {field: why}}}, the reason each None value has (a None value without one says "not recorded")."""
    import matplotlib.pyplot as plt

    impls = list(recorded) + [i for i in (live or {}) if i not in recorded]
    colors = {i: IMPL_COLORS.get(i) or RUN_COLORS.get(i) or _OTHER_COLORS[n % len(_OTHER_COLORS)]
              for n, i in enumerate(impls)}
    sources = [("recorded", f"recorded, {recorded_gpu}", recorded, None)]
    if live is not None:
        sources.append(("live", f"measured now, {gpu_name()}", live, "//"))
    rows = max(1, len(impls)) * len(sources)
    # One panel per field, stacked: each as wide as the output area, so the long names and reasons read whole.
    fig, axes = plt.subplots(len(fields), 1, figsize=(WIDTH, 0.5 + (1.0 + 0.36 * rows) * len(fields)), squeeze=False,
                             sharey=True)
    height = 0.8 / len(sources)
    for ax, field in zip(axes[:, 0], fields):
        top = max([v for _, _, values, _ in sources for v in _column(values, impls, field) if v is not None],
                  default=1.0)
        for s, (key, _, values, hatch) in enumerate(sources):
            ys = np.arange(len(impls)) + (s - (len(sources) - 1) / 2) * height
            for y, impl, value in zip(ys, impls, _column(values, impls, field)):
                if value is None:
                    why = ((missing or {}).get(key, {}).get(impl, {}).get(field)) or "not recorded"
                    _missing_marker(ax, y, colors[impl], why, top)
                    continue
                ax.barh(y, value, height=height * 0.9, hatch=hatch, color=colors[impl],
                        edgecolor="white" if hatch else None)
                ax.text(value + 0.01 * top, y, _label(field, value), va="center", ha="left", fontsize=FONT - 1)
        if field == SPEEDUP:
            ax.axvline(1.0, color="black", lw=0.8, ls="--")  # the baseline itself
        ax.set_xlim(0, top * 1.2)  # room for the values right of the bars
        ax.set_xlabel(FIELD_LABELS[field], fontsize=FONT)
        ax.tick_params(labelsize=FONT - 1)
        ax.grid(True, axis="x", alpha=0.25)
    axes[0][0].set_yticks(range(len(impls)), [textwrap.fill(i, 40) for i in impls])
    for ax in axes[:, 0]:  # the names, in every stacked panel alike
        ax.tick_params(axis="y", labelsize=FONT)
    axes[0][0].set_ylim(max(len(impls), 1) - 0.5, -0.5)  # the first implementation on top
    if not impls:
        axes[0][0].text(0.5, 0, "no implementation chosen", ha="center", va="center", fontsize=FONT)
    if len(sources) > 1:
        from matplotlib.patches import Patch

        handles = [Patch(facecolor="#8c8c8c", hatch=hatch, edgecolor="white" if hatch else None, label=label)
                   for _, label, _, hatch in sources]
        fig.legend(handles=handles, loc="upper right", fontsize=FONT - 1, frameon=False, ncol=len(sources))
    fig.suptitle(title, fontsize=FONT + 1, x=0.01, ha="left")
    return finish(fig, provenance, bottom=0.4 / fig.get_figheight())  # two lines of footnote


def _column(values: dict, impls, field) -> list:
    return [(values.get(i) or {}).get(field) for i in impls]


def _missing_marker(ax, y, color, why: str, top: float) -> None:
    """No bar: a cross at zero in the implementation's colour, and the reason beside it (wrapped, at most two
    lines; the printed text above the figure has it whole)."""
    ax.plot([0], [y], marker="x", color=color, markersize=8, mew=2, clip_on=False, zorder=3)
    lines = textwrap.wrap(why, 52)
    text = "\n".join(lines[:2]) + ("…" if len(lines) > 2 else "")
    ax.text(0.03 * top, y, text, va="center", ha="left", fontsize=FONT - 2, color=MISSING_COLOR, style="italic")


def _label(field: str, value: float) -> str:
    return f"{value:,.2f}x" if field == SPEEDUP else _number(value)


def _number(value: float) -> str:
    """3,823 rather than 3.82e+03; three significant digits below 100."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
