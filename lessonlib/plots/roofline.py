"""Lesson 00: the roofline."""

from __future__ import annotations

import numpy as np

from lessonlib.results import Ceilings
from lessonlib.plots._figure import figure, finish, plain_log_ticks


def roofline(ceilings: Ceilings, points: list[tuple[str, float, float | None]] = (), ax=None):
    """The roofline: attainable TFLOP/s against arithmetic intensity (FLOP per byte), log-log.

    ``points``: (label, intensity, measured TFLOP/s or None). Points without a measurement sit on the roof, where
    the model says they can at best be.
    """
    fig, ax = figure(ax, (7.5, 4.8))
    ridge = ceilings.ridge_intensity
    x = np.logspace(-2, 4, 400)
    roof = np.minimum(x * ceilings.bandwidth_gbs / 1e3, ceilings.matmul_tflops)
    ax.loglog(x, roof, color="black", lw=2)
    ax.axvline(ridge, color="#999999", ls=":", lw=1)
    ax.text(ridge * 1.1, ceilings.matmul_tflops * 0.02, f"ridge: {ridge:.0f} FLOP/byte", fontsize=8, color="#555555")
    ax.fill_between(x, roof, 1e-3, where=x < ridge, color="#fde0dd", alpha=0.5, label="memory-bound")
    ax.fill_between(x, roof, 1e-3, where=x >= ridge, color="#deebf7", alpha=0.5, label="compute-bound")
    for i, (label, intensity, measured) in enumerate(points):
        attainable = min(intensity * ceilings.bandwidth_gbs / 1e3, ceilings.matmul_tflops)
        y = attainable if measured is None else measured
        marker = "o" if measured is None else "*"
        ax.plot([intensity], [y], marker, ms=9, color=f"C{i}", label=f"{label}: {intensity:.2f} FLOP/B")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_ylim(1e-2, ceilings.matmul_tflops * 2)
    ax.set_title(f"Roofline: {ceilings.bandwidth_gbs:,.0f} GB/s copy, {ceilings.matmul_tflops:,.0f} TFLOP/s bf16 matmul")
    ax.legend(loc="lower right", fontsize=7)
    ax.grid(True, which="both", alpha=0.2)
    plain_log_ticks(ax)
    return finish(fig, f"ceilings {ceilings.source}", bottom=0.04)
