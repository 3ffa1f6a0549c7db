"""Lesson 07's figures on serving latency (the engine's own plots of its step log are in engine/lesson.py)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from lessonlib.plots._figure import IMPL_COLORS, finish
from lessonlib.results import Impl, Op, Results

MODE_COLORS = {Impl.PREFILL_FIRST: IMPL_COLORS[Impl.EAGER], Impl.CHUNKED_PREFILL: IMPL_COLORS[Impl.LESSONLIB]}


def chunked_prefill_timeline(results: Results, footnote: str | None = None):
    """One long prompt arriving among running decodes (``lessonlib.cases.chunked_prefill``). Top: each mode's steps
    on a time line from the prompt's arrival, a box per step, green when the decodes got a token from it, grey when
    they waited, a star at the prompt's first token. Bottom: the decodes' inter-token gaps, each drawn at the token
    that ends it. ``footnote``: the provenance (default: the results file's)."""
    rows = {r["impl"]: r for r in results.select(op=Op.STEP_TIMELINE)}
    modes = [m for m in (Impl.PREFILL_FIRST, Impl.CHUNKED_PREFILL) if m in rows]
    fig, (steps_ax, gaps_ax) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(1, 1.4))
    for y, mode in enumerate(reversed(modes)):
        rec = rows[mode]
        boxes = [(s["end"] - s["seconds"], s["seconds"]) for s in rec["steps"]]
        colours = ["#2ca02c" if any(s["tokens"][:-1]) else "#bbbbbb" for s in rec["steps"]]
        steps_ax.broken_barh(boxes, (y - 0.35, 0.7), facecolors=colours, edgecolors="white", linewidth=1.5)
        steps_ax.plot(rec["ttft_s"], y + 0.42, marker="*", markersize=13, color=MODE_COLORS[mode], clip_on=False)
        steps_ax.text(rec["ttft_s"], y + 0.42, f"  first token of the long prompt: {rec['ttft_s']:.2f} s",
                      va="center", fontsize=8)
    steps_ax.set_yticks(range(len(modes)), [m.split(" (")[0] for m in reversed(modes)])
    steps_ax.set_ylim(-0.6, len(modes) - 0.2)
    steps_ax.set_title("engine steps after the long prompt arrives (green: the decodes got a token; grey: they "
                       "waited)", fontsize=9)
    top = 0.0
    for mode in modes:
        rec = rows[mode]
        decodes = len(rec["steps"][0]["tokens"]) - 1
        arrivals = [0.0] + [s["end"] for s in rec["steps"] if any(s["tokens"][:decodes])]
        gaps = [1e3 * (b - a) for a, b in zip(arrivals, arrivals[1:])]
        gaps_ax.plot(arrivals[1:], gaps, marker="o", color=MODE_COLORS[mode],
                     label=f"{mode}: longest gap {max(gaps):.0f} ms")
        top = max(top, *gaps)
    gaps_ax.set_ylim(0, 1.45 * top)  # room for the legend above the points
    gaps_ax.set_xlim(left=0)
    gaps_ax.set_xlabel("seconds since the long prompt arrived")
    gaps_ax.set_ylabel("decode inter-token gap (ms)")
    shape = rows[modes[0]]["shape"]
    gaps_ax.set_title(f"{shape['decodes']} running decodes, one {shape['prompt']}-token prompt arriving, "
                      f"token budget {shape['budget']} per step", fontsize=9)
    gaps_ax.legend(fontsize=8, loc="upper left")
    return finish(fig, footnote or results.provenance(), bottom=0.06)
