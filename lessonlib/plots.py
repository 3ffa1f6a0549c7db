"""Figures the notebooks call instead of pasting plotting code. Each returns the matplotlib Figure.

Recorded GPU results always carry their provenance (GPU, versions, date, command) in a footnote, so a figure shown
on a laptop never passes for a live measurement.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from lessonlib.measure import Ceilings
from lessonlib.results import Results
from lessonlib.traffic import OpTraffic

IMPL_COLORS = {
    "eager": "#d62728",
    "torch.compile": "#1f77b4",
    "lessonlib": "#2ca02c",
    "copy (same bytes)": "#7f7f7f",
}


def _plain_log_ticks(ax) -> None:
    """Label log axes 0.01 … 1000 in plain text. The default labels (10^k) go through matplotlib's mathtext parser,
    which is not safe to call from two threads at once, and a widget callback in JupyterLab may run on a kernel
    subshell's thread (seen as an intermittent "ParseException: Expected end of text" on a slider move)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(NullFormatter())


def _footnote(fig, text: str) -> None:
    fig.text(0.01, 0.005, text, fontsize=7, color="#555555", ha="left", va="bottom", wrap=True)


def roofline(ceilings: Ceilings, points: list[tuple[str, float, float | None]] = (), ax=None):
    """The roofline: attainable TFLOP/s against arithmetic intensity (FLOP per byte), log-log.

    ``points``: (label, intensity, measured TFLOP/s or None). Points without a measurement sit on the roof, where
    the model says they can at best be.
    """
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4.8))
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
    _plain_log_ticks(ax)
    _footnote(fig, f"ceilings {ceilings.source}")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def traffic(op: OpTraffic, ax=None):
    """Bytes moved per kernel, eager chain vs fused, as two stacked bars."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4.2))
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
    fig.tight_layout()
    return fig


def bandwidth(results: Results, op: str, shape: dict, ceiling_gbs: float | None = None, live: dict | None = None, ax=None):
    """GB/s of each implementation of ``op`` at ``shape`` from a recorded run, beside its copy ceiling. ``live`` (the
    student's own {impl: GB/s}, with "copy (same bytes)" measured in the same run) gets a panel of its own, on its
    own axis and ceiling: a T4's 300 GB/s drawn on an H200's 4,000 GB/s axis would be a sliver."""
    if live and ax is None:
        fig, (ax, live_ax) = plt.subplots(1, 2, figsize=(13, 4.2))
    else:
        fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4.2))
        live_ax = None
    impls = ["eager", "torch.compile", "lessonlib", "copy (same bytes)"]
    recs = {r["impl"]: r for r in results.select(op=op, **shape) if "regime" not in r}
    recs["copy (same bytes)"] = results.one(op="copy", **shape)
    _bandwidth_bars(ax, impls, {i: recs[i]["gbps"] for i in impls}, ceiling_gbs or results.ceilings["bandwidth_gbs"],
                    f"recorded on {results.environment['gpu']}")
    ax.set_title(f"{op} at " + ", ".join(f"{k}={v}" for k, v in shape.items()) + f", {recs['lessonlib']['dtype']}: "
                 f"recorded on {results.environment['gpu']}", fontsize=10)
    if live_ax is not None:
        _bandwidth_bars(live_ax, impls, live, live["copy (same bytes)"], "measured now on your GPU", hatch="//")
        live_ax.set_title(f"{op}, your GPU ({_gpu_name()})", fontsize=10)
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


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


def _gpu_name() -> str:
    from lessonlib import runtime

    profile = runtime.gpu_profile()
    return profile.name if profile is not None else "CPU"


def per_call_time(results: Results, op: str, ax=None):
    """Time per call against the number of tokens, for each implementation, calls back to back (log-log)."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4.2))
    for impl in ("eager", "torch.compile", "lessonlib"):
        recs = sorted(results.select(op=op, impl=impl, regime="per call, back to back"), key=lambda r: r["shape"]["T"])
        ax.loglog([r["shape"]["T"] for r in recs], [r["us"] for r in recs], "o-", color=IMPL_COLORS[impl], label=impl)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("µs per call")
    ax.set_title(f"{op}: below ~1k tokens the time is launch overhead, not bytes")
    ax.legend()
    ax.grid(True, which="both", alpha=0.2)
    _plain_log_ticks(ax)
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def launch_overhead(results: Results, ax=None):
    """Where a one-token swiglu call's time goes, from the recorded breakdown."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 3.6))
    recs = results.select(op="launch_overhead")
    labels = [r["impl"] for r in recs]
    ax.barh(range(len(recs)), [r["us"] for r in recs], color=["#9ecae1"] * 3 + [IMPL_COLORS["lessonlib"], IMPL_COLORS["eager"]])
    for i, r in enumerate(recs):
        ax.text(r["us"], i, f" {r['us']:.1f} µs", va="center", fontsize=9)
    ax.set_yticks(range(len(recs)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("µs per call (calls back to back, T=1)")
    ax.set_title("One decode-size swiglu call: host-side work, not the GPU, is the time")
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def gated_mlp(results: Results, ax=None):
    """The whole GatedMLP, eager vs fused vs torch.compile, with the elementwise part shown separately."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4.2))
    tokens = sorted({r["shape"]["T"] for r in results.select(op="gated_mlp")})
    eager = [results.one(op="gated_mlp", impl="eager", T=t)["us"] for t in tokens]
    impls = {"eager": IMPL_COLORS["eager"], "lessonlib (gate_up GEMM + swiglu)": IMPL_COLORS["lessonlib"],
             "torch.compile": IMPL_COLORS["torch.compile"]}
    width = 0.25
    for j, (impl, color) in enumerate(impls.items()):
        rel = [results.one(op="gated_mlp", impl=impl, T=t)["us"] / e for t, e in zip(tokens, eager)]
        xs = np.arange(len(tokens)) + (j - 1) * width
        ax.bar(xs, rel, width, color=color, label=impl)
        for x, r in zip(xs, rel):
            ax.text(x, r, f"{r:.2f}", ha="center", va="bottom", fontsize=7)
    elementwise = [results.one(op="gated_mlp", impl="of which: eager silu·mul", T=t)["us"] / e for t, e in zip(tokens, eager)]
    ax.plot(np.arange(len(tokens)) - width, elementwise, "v", color="black", label="eager's silu·mul share")
    ax.set_xticks(range(len(tokens)), [f"T={t}" for t in tokens])
    ax.set_ylabel("time relative to eager (lower is faster)")
    ax.set_ylim(0, max(1.3, ax.get_ylim()[1]) * 1.35)
    ax.set_title("Whole GatedMLP (H=4096, I=14336): the GEMMs dominate,\nfusion can only save the elementwise share")
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def register_pressure(results: Results, ax=None):
    """One-pass (whole row in registers) vs two-pass add_rms_norm as the row widens: registers, spills, GB/s."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4.2))
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
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def launch_counts(counts: dict[str, dict[str, int]], title: str, ax=None):
    """Kernel launches per call: {op: {impl: count}} as grouped bars."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 3.8))
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
    fig.tight_layout()
    return fig


def block_tables(panels: dict[str, dict[str, list[int]]], ref_counts: dict[str, dict[int, int]] | None = None):
    """Block tables side by side, one panel per block manager: a row per sequence, a box per logical block
    labelled with its physical block id. A block two sequences share is drawn in the same colour in both rows and
    outlined in black (its reference count is above 1)."""
    ref_counts = ref_counts or {}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 0.8 + 0.75 * max(len(t) for t in panels.values())),
                             squeeze=False)
    for ax, (title, tables) in zip(axes[0], panels.items()):
        counts = ref_counts.get(title, {})
        width = max((len(blocks) for blocks in tables.values()), default=1)
        for row, (seq_id, blocks) in enumerate(tables.items()):
            for logical, physical in enumerate(blocks):
                shared = counts.get(physical, 1) > 1
                ax.add_patch(plt.Rectangle((logical, -row - 0.8), 0.9, 0.7, facecolor=plt.cm.tab20(physical % 20),
                                           edgecolor="black" if shared else "white", lw=2 if shared else 1))
                ax.text(logical + 0.45, -row - 0.45, str(physical), ha="center", va="center", fontsize=10)
            ax.text(-0.15, -row - 0.45, str(seq_id), ha="right", va="center", fontsize=10)
        ax.set_xlim(-1.6, width + 0.2)
        ax.set_ylim(-len(tables) - 0.1, 0.5)
        ax.set_xticks([i + 0.45 for i in range(width)], [str(i) for i in range(width)])
        ax.set_xlabel("logical block (box: physical block id; black outline: shared)")
        ax.set_yticks([])
        ax.set_title(title, fontsize=10)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def score_bytes(tokens: int, heads: int = 32, head_dim: int = 128, itemsize: int = 2, memory_bytes: float = 141e9,
                ax=None):
    """Naive attention's score matrix (T² per head) against FlashAttention's inputs and output (linear in T), one
    layer, log-log, with the GPU's memory as a line."""
    from lessonlib.traffic import attention_io_bytes, score_matrix_bytes

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4.2))
    t = np.unique(np.logspace(8, 17.5, 60, base=2).astype(int))
    ax.loglog(t, [score_matrix_bytes(int(n), heads, itemsize) for n in t], color=IMPL_COLORS["eager"],
              label=f"score matrix, {heads} heads (naive attention): T²")
    ax.loglog(t, [attention_io_bytes(int(n), heads, head_dim, itemsize) for n in t], color=IMPL_COLORS["lessonlib"],
              label="Q, K, V and O (all FlashAttention moves): T")
    ax.axhline(memory_bytes, color="black", ls="--", lw=1)
    ax.text(t[0], memory_bytes * 1.3, f"H200 memory, {memory_bytes / 1e9:.0f} GB", fontsize=8)
    scores = score_matrix_bytes(tokens, heads, itemsize)
    ax.plot([tokens], [scores], "o", color=IMPL_COLORS["eager"], ms=8)
    ax.annotate(f"T={tokens:,}: {scores / 1e9:,.2f} GB", (tokens, scores), textcoords="offset points", xytext=(-10, 10),
                ha="right", fontsize=9)
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("bytes, one layer, batch 1")
    ax.set_title("The score matrix grows with T², the attention's inputs and output with T")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", alpha=0.2)
    _plain_log_ticks(ax)
    fig.tight_layout()
    return fig


def online_softmax(trace: list[dict], step: int, exact: np.ndarray, ax=None):
    """One query row's online softmax after ``step`` tiles: running max and sum, and the output's first components
    converging to the exact attention output."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6)) if ax is None else (ax[0].figure, ax)
    seen = [s["keys_seen"] for s in trace]
    shown = trace[: step + 1]
    axes[0].plot(seen[: step + 1], [s["m"] for s in shown], "o-", label="running max m")
    axes[0].plot(seen[: step + 1], [np.log(s["l"]) + s["m"] for s in shown], "s-", label="log-sum-exp m + log l")
    axes[0].set_xlim(0, seen[-1] * 1.05)
    axes[0].set_xlabel("keys seen")
    axes[0].set_title("running statistics")
    axes[0].legend(fontsize=8)
    components = min(4, exact.shape[0])
    for c in range(components):
        axes[1].plot(seen[: step + 1], [s["out"][c].item() for s in shown], "o-", color=f"C{c}", label=f"out[{c}]")
        axes[1].axhline(exact[c], color=f"C{c}", ls=":", lw=1)
    axes[1].set_xlim(0, seen[-1] * 1.05)
    axes[1].set_xlabel("keys seen")
    axes[1].set_title("output so far (dotted: exact attention)")
    axes[1].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def tile_plan(plan, block_m: int, block_n: int, title: str, ax=None, legend: bool = True):
    """The forward kernel's work per (query tile, key tile): skipped, computed, or computed with a mask."""
    from matplotlib.colors import ListedColormap

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(5.6, 4.2))
    plan = np.asarray(plan)
    colours = ListedColormap(["#f0f0f0", "#74c476", "#fd8d3c"])
    ax.imshow(plan, cmap=colours, vmin=0, vmax=2)
    counts = [int((plan == v).sum()) for v in (0, 1, 2)]
    ax.set_xticks(range(plan.shape[1]))
    ax.set_yticks(range(plan.shape[0]))
    ax.set_xlabel(f"key tile ({block_n} keys each)")
    ax.set_ylabel(f"query tile ({block_m} queries each)")
    ax.set_title(f"{title}\nskipped {counts[0]}, no mask {counts[1]}, masked {counts[2]}", fontsize=9)
    if legend:
        handles = [plt.Rectangle((0, 0), 1, 1, color=colours(i)) for i in range(3)]
        ax.legend(handles, ["skipped", "computed", "computed + mask"], fontsize=8, loc="upper left",
                  bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return fig


def attention_speed(results: Results, causal: bool, op: str = "forward", ax=None):
    """TFLOP/s of the forward (or ``op="backward"``) against sequence length per implementation, from a recorded
    benchmark run; points where an implementation ran out of memory or was refused are marked at 0."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7.5, 4.2))
    impls = sorted({r["impl"] for r in results.select(op=op) if r["shape"]["D"] == 128 and "BLOCK" not in r["impl"]})
    for i, impl in enumerate(impls):
        recs = sorted((r for r in results.select(op=op, impl=impl) if r["shape"]["D"] == 128
                       and r["shape"]["causal"] == causal and r["shape"]["H"] == 32 and r["shape"]["B"] * r["shape"]["N"] == 16384),
                      key=lambda r: r["shape"]["N"])
        ok = [r for r in recs if r["us"] is not None]
        color = IMPL_COLORS.get(impl, f"C{i + 3}")
        ax.plot([r["shape"]["N"] for r in ok], [r["tflops"] for r in ok], "o-", label=impl, color=color)
        for r in recs:
            if r["us"] is None:
                ax.plot([r["shape"]["N"]], [0], "x", color=color, ms=10)
    ax.set_xscale("log", base=2)
    _plain_log_ticks(ax)
    ax.set_xlabel("sequence length N (batch x N = 16k tokens, 32 heads, D=128)")
    ax.set_ylabel(f"TFLOP/s ({op})")
    ax.set_title(f"Attention {op}, {'causal' if causal else 'full'} (x at 0: out of memory or refused)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.2)
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


FORWARD_BUDGET = (  # (record's impl in op "forward variant", label, colour)
    ("matrix products alone (no softmax)", "the loop's matrix products alone\n(softmax removed: not attention)", "#6baed6"),
    ("loop copy, unchanged", "the whole loop\n(a copy of lessonlib's)", IMPL_COLORS["lessonlib"]),
    ("lazy rescale (FlashAttention-4)", "... rescaling only when the\nmaximum grows by > 2^8", "#a1d99b"),
    ("exp2 in 16 bits", "... exp2 in 16 bits\n(2 per instruction)", "#a1d99b"),
)


def forward_time_budget(results: Results, shape: dict, ax=None):
    """Where the forward's time goes, from one recorded run: the time its FLOPs take at the measured matmul rate, the
    benchmark's copies of lessonlib's loop changed one way at a time (``op="forward variant"``), and cuDNN."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(8.5, 4.4))
    flops = 4 * shape["B"] * shape["H"] * shape["N"] ** 2 * shape["D"]
    rows = [("its FLOPs at the measured\nmatmul rate (cuBLAS)", flops / (results.ceilings["matmul_tflops"] * 1e12) * 1e6,
             "#bdbdbd")]
    rows += [(label, results.one(op="forward variant", impl=impl, **shape)["us"], color)
             for impl, label, color in FORWARD_BUDGET]
    rows += [("cuDNN (SDPA)", r["us"], "#9467bd") for r in results.select(op="forward", impl="SDPA cudnn", **shape)]
    ys = np.arange(len(rows))[::-1]
    ax.barh(ys, [us for _, us, _ in rows], color=[c for _, _, c in rows], height=0.6)
    ax.set_yticks(ys, [label for label, _, _ in rows], fontsize=8)
    matmuls = rows[1][1]
    for i, (y, (_, us, _)) in enumerate(zip(ys, rows)):
        extra = f"\n  +{us - matmuls:,.0f} us over the matrix products" if i > 1 else ""
        ax.text(us, y, f" {us:,.0f} us = {flops / (us * 1e-6) / 1e12:.0f} TFLOP/s{extra}", va="center", fontsize=8)
    ax.axvline(matmuls, color="#6baed6", ls="--", lw=1)
    ax.set_xlim(0, max(us for _, us, _ in rows) * 1.6)
    ax.set_xlabel("microseconds per forward (shorter is faster)")
    ax.set_title(f"Where the forward's time goes: B={shape['B']} H={shape['H']} N={shape['N']} D={shape['D']}, full")
    ax.grid(True, axis="x", alpha=0.2)
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def kv_reservation(lengths, reservation, bytes_per_token: int, max_len: int, block_size: int):
    """Left: how long the requests are. Right: KV memory used vs held by paged blocks vs reserved as slabs."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1.2, 1]})
    left.hist(np.asarray(lengths), bins=40, color="#9ecae1")
    left.axvline(max_len, color=IMPL_COLORS["eager"], ls="--")
    left.text(max_len, left.get_ylim()[1] * 0.9, f" max_len {max_len:,}", color=IMPL_COLORS["eager"], fontsize=8,
              ha="right" if max_len > np.asarray(lengths).max() * 0.7 else "left")
    left.set_xlabel("tokens per request (prompt + output)")
    left.set_ylabel("requests")
    left.set_title(f"{len(lengths)} requests, median {int(np.median(np.asarray(lengths))):,} tokens", fontsize=10)
    gb = [t * bytes_per_token / 1e9 for t in (reservation.used_tokens, reservation.paged_tokens,
                                              reservation.contiguous_tokens)]
    labels = ["used\n(every token's K, V)", f"paged\n(blocks of {block_size})", f"contiguous\n(slab of {max_len:,})"]
    bars = right.bar(labels, gb, color=["#74c476", IMPL_COLORS["lessonlib"], IMPL_COLORS["eager"]])
    for bar, value, waste in zip(bars, gb, (0.0, reservation.paged_waste, reservation.contiguous_waste)):
        right.text(bar.get_x() + bar.get_width() / 2, value, f"{value:,.1f} GB\n{waste:.0%} unused", ha="center",
                   va="bottom", fontsize=8)
    right.set_ylabel("KV cache memory, GB")
    right.set_ylim(0, max(gb) * 1.25)
    right.set_title("memory held for the same requests", fontsize=10)
    fig.tight_layout()
    return fig


def paged_attention_speed(results: Results, ax=None):
    """Decode attention GB/s per shape: lessonlib's paged kernel against SDPA on a contiguous cache, gather+SDPA and
    FlexAttention's paged attention. GPU time (each call replayed from a CUDA graph) where the run recorded it."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(9, 4.2))
    impls = ["lessonlib", "SDPA, contiguous cache", "gather pages, then SDPA", "FlexAttention paged"]
    colours = [IMPL_COLORS["lessonlib"], IMPL_COLORS["torch.compile"], "#9ecae1", "#ff7f0e"]
    shapes = []
    for rec in results.select(op="paged_attention", impl="lessonlib"):
        key = (rec["shape"]["B"], rec["shape"]["context"])
        if key not in shapes:
            shapes.append(key)
    graph_timed = any(r.get("graph_gbps") for r in results.select(op="paged_attention"))
    width = 0.8 / len(impls)
    for i, (impl, colour) in enumerate(zip(impls, colours)):
        xs = np.arange(len(shapes)) + (i - (len(impls) - 1) / 2) * width
        for x, (b, c) in zip(xs, shapes):
            found = results.select(op="paged_attention", impl=impl, B=b, context=c)
            value = found and (found[0].get("graph_gbps") or found[0].get("gbps"))
            if value:
                ax.bar(x, value, width, color=colour)
            elif found:  # recorded with an error: this peer does not run at this shape
                ax.text(x, 0, "x", ha="center", va="bottom", color=colour, fontsize=11, fontweight="bold")
    ax.axhline(results.ceilings["bandwidth_gbs"], color="black", ls="--", lw=1)
    ax.text(len(shapes) - 0.5, results.ceilings["bandwidth_gbs"], "copy ceiling (read + write)", ha="right",
            va="bottom", fontsize=8)
    ax.set_xticks(range(len(shapes)), [f"B={b}\ncontext {c:,}" for b, c in shapes])
    ax.set_ylabel("GB/s of K and V read" + (" (GPU time, graph-replayed)" if graph_timed else ""))
    ax.set_ylim(0, results.ceilings["bandwidth_gbs"] * 1.35)
    ax.set_title("Decode attention, 32 query heads over 8 KV heads, D=128, 16-token blocks"
                 "\n(x: FlexAttention refused 16-token pages at that shape)", fontsize=10)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=i) for i, c in zip(impls, colours)], fontsize=8, loc="upper left", ncol=4)
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def decode_step_times(results: Results, ax=None):
    """One decoder layer's decode step: eager PyTorch, lessonlib's fused kernels, and the fused step replayed from
    a CUDA graph, at each batch size and context; the kernels per step written on each bar."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(11, 4.4))
    impls = {"eager PyTorch step": IMPL_COLORS["eager"], "lessonlib fused step": IMPL_COLORS["lessonlib"],
             "lessonlib fused step, CUDA graph": "#6a3d9a"}
    shapes = []
    for rec in results.select(op="decode_step"):
        key = (rec["shape"]["B"], rec["shape"]["context"])
        if key not in shapes:
            shapes.append(key)
    width = 0.8 / len(impls)
    for i, (impl, colour) in enumerate(impls.items()):
        xs = np.arange(len(shapes)) + (i - 1) * width
        recs = [results.one(op="decode_step", impl=impl, B=b, context=c) for b, c in shapes]
        ax.bar(xs, [r["us"] for r in recs], width, color=colour, label=impl)
        for x, r in zip(xs, recs):
            ax.text(x, r["us"], f"{r['us']:,.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    _plain_log_ticks(ax)
    ax.set_ylim(top=ax.get_ylim()[1] * 4)

    def kernels(b, c):
        counts = [results.one(op="decode_step", impl=impl, B=b, context=c).get("launches") for impl in impls]
        return "" if None in counts else "\nkernels " + " / ".join(map(str, counts))

    ax.set_xticks(range(len(shapes)), [f"B={b}, context {c:,}{kernels(b, c)}" for b, c in shapes], fontsize=8)
    ax.set_ylabel("µs per decode step (log)")
    ax.set_title("One decoder layer's decode step (hidden 4096, 32/8 heads, D=128): µs per step", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    ax.grid(True, axis="y", alpha=0.2)
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def launch_modes(results: Results, ax=None):
    """The GatedMLP at T tokens: eager, torch.compile, reduce-overhead and a hand-captured graph, relative to eager."""
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(8, 4.0))
    tokens = sorted({r["shape"]["T"] for r in results.select(op="gated_mlp")})
    impls = {"eager": IMPL_COLORS["eager"], "torch.compile": IMPL_COLORS["torch.compile"],
             "torch.compile reduce-overhead": "#17becf", "CUDA graph (by hand)": "#6a3d9a"}
    width = 0.8 / len(impls)
    for i, (impl, colour) in enumerate(impls.items()):
        xs = np.arange(len(tokens)) + (i - 1.5) * width
        recs = [results.one(op="gated_mlp", impl=impl, T=t) for t in tokens]
        eager = [results.one(op="gated_mlp", impl="eager", T=t)["us"] for t in tokens]
        ax.bar(xs, [r["us"] / e for r, e in zip(recs, eager)], width, color=colour, label=impl)
        for x, r in zip(xs, recs):
            ax.text(x, 0.02, f"{r['us']:,.0f} µs", rotation=90, ha="center", va="bottom", fontsize=7, color="white")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(tokens)), [f"T={t}" for t in tokens])
    ax.set_ylabel("time relative to eager (lower is faster)")
    ax.set_ylim(0, 1.5)
    ax.set_title("GatedMLP (H=4096, I=14336): four ways to launch the same work", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=4)
    _footnote(fig, results.provenance())
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig
