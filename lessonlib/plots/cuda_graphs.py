"""Lessons 04 and 05: launch modes and the decode step, from the recorded CUDA-graphs run."""

from __future__ import annotations

import numpy as np

from lessonlib.results import Impl, Op, Results
from lessonlib.plots._figure import IMPL_COLORS, WIDTH, figure, finish, plain_log_ticks
from lessonlib.plots.recorded import RUN_COLORS


def decode_step_times(results: Results, ax=None):
    """One decoder layer's decode step: eager PyTorch, lessonlib's fused kernels, and the fused step replayed from
    a CUDA graph, at each batch size and context; the kernels per step written on each bar."""
    fig, ax = figure(ax, (WIDTH, 4.6))
    impls = {i: RUN_COLORS[i] for i in (Impl.EAGER_STEP, Impl.FUSED_STEP, Impl.FUSED_STEP_GRAPH)}
    shapes = []
    for rec in results.select(op=Op.DECODE_STEP):
        key = (rec["shape"]["B"], rec["shape"]["context"])
        if key not in shapes:
            shapes.append(key)
    width = 0.8 / len(impls)
    for i, (impl, colour) in enumerate(impls.items()):
        xs = np.arange(len(shapes)) + (i - 1) * width
        recs = [results.one(op=Op.DECODE_STEP, impl=impl, B=b, context=c) for b, c in shapes]
        ax.bar(xs, [r["us"] for r in recs], width, color=colour, label=impl)
        for x, r in zip(xs, recs):
            ax.text(x, r["us"], f"{r['us']:,.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    plain_log_ticks(ax)
    ax.set_ylim(top=ax.get_ylim()[1] * 4)

    def kernels(b, c):
        counts = [results.one(op=Op.DECODE_STEP, impl=impl, B=b, context=c).get("launches") for impl in impls]
        return "" if None in counts else "\nkernels " + "/".join(map(str, counts))

    ax.set_xticks(range(len(shapes)), [f"B={b}\ncontext {c:,}{kernels(b, c)}" for b, c in shapes], fontsize=8)
    ax.set_ylabel("µs per decode step (log)")
    ax.set_title("One decoder layer's decode step (hidden 4096, 32/8 heads, D=128): µs per step", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    ax.grid(True, axis="y", alpha=0.2)
    return finish(fig, results.provenance())

def launch_modes(results: Results, ax=None):
    """The GatedMLP at T tokens: eager, torch.compile, reduce-overhead and a hand-captured graph, relative to eager."""
    fig, ax = figure(ax, (8, 4.0))
    tokens = sorted({r["shape"]["T"] for r in results.select(op=Op.GATED_MLP)})
    impls = {Impl.EAGER: IMPL_COLORS[Impl.EAGER], Impl.COMPILE: IMPL_COLORS[Impl.COMPILE],
             Impl.COMPILE_REDUCE_OVERHEAD: RUN_COLORS[Impl.COMPILE_REDUCE_OVERHEAD],
             Impl.CUDA_GRAPH_BY_HAND: RUN_COLORS[Impl.CUDA_GRAPH_BY_HAND]}
    width = 0.8 / len(impls)
    for i, (impl, colour) in enumerate(impls.items()):
        xs = np.arange(len(tokens)) + (i - 1.5) * width
        recs = [results.one(op=Op.GATED_MLP, impl=impl, T=t) for t in tokens]
        eager = [results.one(op=Op.GATED_MLP, impl=Impl.EAGER, T=t)["us"] for t in tokens]
        ax.bar(xs, [r["us"] / e for r, e in zip(recs, eager)], width, color=colour, label=impl)
        for x, r in zip(xs, recs):
            ax.text(x, 0.02, f"{r['us']:,.0f} µs", rotation=90, ha="center", va="bottom", fontsize=7, color="white")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(tokens)), [f"T={t}" for t in tokens])
    ax.set_ylabel("time relative to eager (lower is faster)")
    ax.set_ylim(0, 1.5)
    ax.set_title("GatedMLP (H=4096, I=14336): four ways to launch the same work", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=4)
    return finish(fig, results.provenance())
