"""Lesson 01's figures: bytes moved, bandwidth against the copy ceiling, launch overhead, where fusion stops paying."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from lessonlib.results import Impl, Op, Regime, Results
from lessonlib.traffic import OpTraffic
from lessonlib.plots._figure import IMPL_COLORS, WIDTH, figure, finish, plain_log_ticks


def traffic_bars(op: OpTraffic, ax=None):
    """Bytes moved per kernel, eager chain vs fused, as two stacked bars."""
    fig, ax = figure(ax, (7.5, 4.2))
    for x, chain in enumerate((op.eager, op.fused)):
        bottom = 0.0
        for i, k in enumerate(chain.kernels):
            mb = k.bytes / 1e6
            ax.bar(x, mb, bottom=bottom, color=plt.cm.tab20(i % 20), edgecolor="white", width=0.6)
            if mb > 0.04 * op.eager.bytes / 1e6:
                ax.text(x, bottom + mb / 2, k.name, ha="center", va="center", fontsize=7)
            bottom += mb
        ax.text(x, bottom, f"{bottom:,.1f} MB\n{chain.launches} launch{'es' if chain.launches > 1 else ''}",
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks([0, 1], ["eager PyTorch", "fused kernel"])
    ax.set_ylabel("bytes read + written (MB)")
    ax.set_ylim(0, op.eager.bytes / 1e6 * 1.25)
    shape = ", ".join(f"{k}={v}" for k, v in op.shape.items())
    ax.set_title(f"{op.op} ({shape}): fused moves {op.byte_ratio:.1f}x fewer bytes")
    return finish(fig)

def bandwidth(results: Results, op: str, shape: dict, ceiling_gbs: float | None = None, live: dict | None = None, ax=None):
    """GB/s of each implementation of ``op`` at ``shape`` from a recorded run, beside its copy ceiling. ``live`` (the
    student's own {impl: GB/s}, with ``Impl.COPY`` measured in the same run) gets a panel of its own, on its
    own axis and ceiling: a T4's 300 GB/s drawn on an H200's 4,000 GB/s axis would be a sliver."""
    if live and ax is None:
        fig, (ax, live_ax) = plt.subplots(1, 2, figsize=(WIDTH, 3.8))
    else:
        fig, ax = figure(ax, (7.5, 4.2))
        live_ax = None
    impls = [Impl.EAGER, Impl.COMPILE, Impl.LESSONLIB, Impl.COPY]
    recs = {r["impl"]: r for r in results.select(op=op, **shape) if "regime" not in r}
    recs.update({r["impl"]: r for r in results.select(op=Op.COPY, **shape)})  # a copy bar where the run timed one
    impls = [i for i in impls if i in recs]
    _bandwidth_bars(ax, impls, {i: recs[i]["gbps"] for i in impls}, ceiling_gbs or results.ceilings["bandwidth_gbs"],
                    f"recorded on {results.environment['gpu']}")
    ax.set_title(f"{op} at " + ", ".join(f"{k}={v}" for k, v in shape.items()) + f", {recs['lessonlib']['dtype']}: "
                 f"recorded on {results.environment['gpu']}", fontsize=10)
    if live_ax is not None:
        _bandwidth_bars(live_ax, impls, live, live[Impl.COPY], "measured now on your GPU", hatch="//")
        live_ax.set_title(f"{op}, your GPU ({gpu_name()})", fontsize=10)
    return finish(fig, results.provenance())

def _bandwidth_bars(ax, impls, values: dict, ceiling: float, label: str, hatch=None) -> None:
    shown = [i for i in impls if i in values]
    bars = ax.bar(range(len(shown)), [values[i] for i in shown], width=0.6, hatch=hatch,
                  color=[IMPL_COLORS[i] for i in shown], edgecolor="white" if hatch else None)
    top = max(ceiling, *values.values())
    for b, i in zip(bars, shown):  # values inside the bars, so none collides with the ceiling's label
        ax.text(b.get_x() + b.get_width() / 2, values[i] - 0.02 * top, f"{values[i]:,.0f}", ha="center", va="top",
                fontsize=9, color="white", fontweight="bold")
    ax.axhline(ceiling, color="black", ls="--", lw=1)
    ax.text(-0.4, top * 1.04, f"copy ceiling {ceiling:,.0f} GB/s ({label})", ha="left", va="bottom", fontsize=8)
    ax.set_xticks(range(len(shown)), shown)
    ax.set_ylabel("GB/s (fewest bytes the op must move / time)")
    ax.set_ylim(0, top * 1.15)

def gpu_name() -> str:
    from lessonlib import runtime

    profile = runtime.gpu_profile()
    return profile.name if profile is not None else "CPU"

def per_call_time(results: Results, op: str, ax=None):
    """Time per call against the number of tokens, for each implementation, calls back to back (log-log)."""
    fig, ax = figure(ax, (7.5, 4.2))
    for impl in (Impl.EAGER, Impl.COMPILE, Impl.LESSONLIB):
        recs = sorted(results.select(op=op, impl=impl, regime=Regime.PER_CALL), key=lambda r: r["shape"]["T"])
        ax.loglog([r["shape"]["T"] for r in recs], [r["us"] for r in recs], "o-", color=IMPL_COLORS[impl], label=impl)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("µs per call")
    ax.set_title(f"{op}: below ~1k tokens the time is launch overhead, not bytes")
    ax.legend()
    ax.grid(True, which="both", alpha=0.2)
    plain_log_ticks(ax)
    return finish(fig, results.provenance())

LAUNCH_STEP_COLORS = {  # the calls a student makes; the host-side steps inside them are light blue
    Impl.OPS_SWIGLU: IMPL_COLORS[Impl.LESSONLIB], Impl.OPS_ADD_RMS_NORM: IMPL_COLORS[Impl.LESSONLIB],
    Impl.EAGER_SILU_MUL: IMPL_COLORS[Impl.EAGER],
}


def launch_overhead(results: Results, ax=None):
    """Where a one-token swiglu call's time goes, from the recorded breakdown."""
    fig, ax = figure(ax, (7.5, 3.6))
    recs = results.select(op=Op.LAUNCH_OVERHEAD)
    labels = [r["impl"] for r in recs]
    ax.barh(range(len(recs)), [r["us"] for r in recs], color=[LAUNCH_STEP_COLORS.get(r["impl"], "#9ecae1") for r in recs])
    for i, r in enumerate(recs):
        ax.text(r["us"], i, f" {r['us']:.1f} µs", va="center", fontsize=9)
    ax.set_yticks(range(len(recs)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("µs per call (calls back to back, T=1)")
    ax.set_title("One decode-size swiglu call: host-side work, not the GPU, is the time")
    return finish(fig, results.provenance(), bottom=0.06)

def gated_mlp(results: Results, ax=None):
    """The whole GatedMLP, eager vs fused vs torch.compile, with the elementwise part shown separately."""
    fig, ax = figure(ax, (7.5, 4.2))
    tokens = sorted({r["shape"]["T"] for r in results.select(op=Op.GATED_MLP)})
    eager = [results.one(op=Op.GATED_MLP, impl=Impl.EAGER, T=t)["us"] for t in tokens]
    impls = {Impl.EAGER: IMPL_COLORS[Impl.EAGER], Impl.FUSED_GATED_MLP: IMPL_COLORS[Impl.LESSONLIB],
             Impl.COMPILE: IMPL_COLORS[Impl.COMPILE]}
    width = 0.25
    for j, (impl, color) in enumerate(impls.items()):
        rel = [results.one(op=Op.GATED_MLP, impl=impl, T=t)["us"] / e for t, e in zip(tokens, eager)]
        xs = np.arange(len(tokens)) + (j - 1) * width
        ax.bar(xs, rel, width, color=color, label=impl)
        for x, r in zip(xs, rel):
            ax.text(x, r, f"{r:.2f}", ha="center", va="bottom", fontsize=7)
    elementwise = [results.one(op=Op.GATED_MLP, impl=Impl.SHARE_EAGER_SILU_MUL, T=t)["us"] / e for t, e in zip(tokens, eager)]
    ax.plot(np.arange(len(tokens)) - width, elementwise, "v", color="black", label="eager's silu·mul share")
    ax.set_xticks(range(len(tokens)), [f"T={t}" for t in tokens])
    ax.set_ylabel("time relative to eager (lower is faster)")
    ax.set_ylim(0, max(1.3, ax.get_ylim()[1]) * 1.35)
    ax.set_title("Whole GatedMLP (H=4096, I=14336): the GEMMs dominate,\nfusion can only save the elementwise share")
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    return finish(fig, results.provenance())

def register_pressure(results: Results, ax=None):
    """One-pass (whole row in registers) vs two-pass add_rms_norm as the row widens: registers, spills, GB/s."""
    fig, ax = figure(ax, (7.5, 4.2))
    rows = results.notes["register_pressure"]["rows"]
    widths = sorted({r["H"] for r in rows})
    for j, one_pass in enumerate((True, False)):
        sel = [next(r for r in rows if r["H"] == h and r["one_pass"] == one_pass) for h in widths]
        xs = np.arange(len(widths)) + (j - 0.5) * 0.38
        ax.bar(xs, [r["gbps"] for r in sel], 0.38, color="#2ca02c" if one_pass else "#9467bd",
               label="one pass: whole row in registers" if one_pass else "two passes: 4096 columns at a time")
        for x, r in zip(xs, sel):
            spill = f"\n{r['spilled_registers']} spilled" if r["spilled_registers"] else ""
            ax.text(x, r["gbps"], f"{r['registers_per_thread']} regs{spill}", ha="center", va="bottom", fontsize=7,
                    color="#d62728" if r["spilled_registers"] else "black")
    ax.set_xticks(range(len(widths)), [f"H={h}" for h in widths])
    ax.set_ylabel("GB/s")
    ax.set_ylim(0, max(r["gbps"] for r in rows) * 1.3)
    ax.set_title("add_rms_norm: a wider row kept in registers needs more of them;\nat 65,536 columns they spill and the fused kernel halves its speed")
    ax.legend(fontsize=8, loc="upper left")
    return finish(fig, results.provenance())

def launch_counts(counts: dict[str, dict[str, int]], title: str, ax=None):
    """Kernel launches per call: {op: {impl: count}} as grouped bars."""
    fig, ax = figure(ax, (7.5, 3.8))
    ops_ = list(counts)
    impls = list(next(iter(counts.values())))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        vals = [counts[o][impl] for o in ops_]
        xs = np.arange(len(ops_)) + (j - (len(impls) - 1) / 2) * width
        ax.bar(xs, vals, width, color=IMPL_COLORS.get(impl, f"C{j}"), label=impl)
        for x, v in zip(xs, vals):
            ax.text(x, v, str(v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ops_)), ops_)
    ax.set_ylabel("kernel launches per call")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return finish(fig)

