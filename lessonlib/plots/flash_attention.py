"""Lesson 02's figures: the score matrix's bytes, the online softmax, the tile plan, recorded attention speed."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from lessonlib.results import Impl, Op, Results, is_sweep
from lessonlib.plots._figure import IMPL_COLORS, WIDTH, figure, finish, plain_log_ticks


def score_bytes(tokens: int, heads: int = 32, head_dim: int = 128, itemsize: int = 2, memory_bytes: float = 141e9,
                ax=None):
    """Naive attention's score matrix (T² per head) against FlashAttention's inputs and output (linear in T), one
    layer, log-log, with the GPU's memory as a line."""
    from lessonlib.traffic import attention_io_bytes, score_matrix_bytes

    fig, ax = figure(ax, (7.5, 4.2))
    t = np.unique(np.logspace(8, 17.5, 60, base=2).astype(int))
    ax.loglog(t, [score_matrix_bytes(int(n), heads, itemsize) for n in t], color=IMPL_COLORS[Impl.NAIVE],
              label=f"score matrix, {heads} heads (naive attention): T²")
    ax.loglog(t, [attention_io_bytes(int(n), heads, head_dim, itemsize) for n in t], color=IMPL_COLORS[Impl.LESSONLIB],
              label="Q, K, V and O (all FlashAttention moves): T")
    ax.axhline(memory_bytes, color="black", ls="--", lw=1)
    ax.text(t[0], memory_bytes * 1.3, f"H200 memory, {memory_bytes / 1e9:.0f} GB", fontsize=8)
    scores = score_matrix_bytes(tokens, heads, itemsize)
    ax.plot([tokens], [scores], "o", color=IMPL_COLORS[Impl.NAIVE], ms=8)
    ax.annotate(f"T={tokens:,}: {scores / 1e9:,.2f} GB", (tokens, scores), textcoords="offset points", xytext=(-10, 10),
                ha="right", fontsize=9)
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("bytes, one layer, batch 1")
    ax.set_title("The score matrix grows with T², the attention's inputs and output with T")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", alpha=0.2)
    plain_log_ticks(ax)
    return finish(fig)

def online_softmax(trace: list[dict], tiles: int, exact: np.ndarray, ax=None):
    """One query row's online softmax after its first ``tiles`` tiles: running max and sum, and the output's first
    components converging to the exact attention output. The components are shades of one colour: they are parts of
    one output, not implementations (green, red, ... name implementations in lesson 02's figures)."""
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.4)) if ax is None else (ax[0].figure, ax)
    seen = [s["keys_seen"] for s in trace]
    shown = trace[:tiles]
    axes[0].plot(seen[:tiles], [s["m"] for s in shown], "o-", color="#252525", label="running max m")
    axes[0].plot(seen[:tiles], [np.log(s["l"]) + s["m"] for s in shown], "s-", color="#969696",
                 label="log-sum-exp m + log l")
    axes[0].set_xlim(0, seen[-1] * 1.05)
    axes[0].set_xlabel("keys seen")
    axes[0].set_title(f"running statistics, {tiles} of {len(trace)} tiles")
    axes[0].legend(fontsize=8)
    components = min(4, exact.shape[0])
    shades = plt.get_cmap("Blues")(np.linspace(0.45, 0.95, components))
    for c in range(components):
        axes[1].plot(seen[:tiles], [s["out"][c].item() for s in shown], "o-", color=shades[c], label=f"out[{c}]")
        axes[1].axhline(exact[c], color=shades[c], ls=":", lw=1)
    axes[1].set_xlim(0, seen[-1] * 1.05)
    axes[1].set_xlabel("keys seen")
    axes[1].set_title("output so far (dotted: exact attention)")
    axes[1].legend(fontsize=8, ncol=2)
    return finish(fig)

def tile_plan_grid(plan, block_m: int, block_n: int, title: str, ax=None, legend: bool = True):
    """The forward kernel's work per (query tile, key tile): skipped, computed, or computed with a mask."""
    from matplotlib.colors import ListedColormap

    fig, ax = figure(ax, (5.6, 4.2))
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
    return finish(fig)

def attention_speed(results: Results, causal: bool, op: str = Op.FORWARD, ax=None):
    """TFLOP/s of the forward (or ``op=Op.BACKWARD``) against sequence length per implementation, from a recorded
    benchmark run; points where an implementation ran out of memory or was refused are marked at 0."""
    fig, ax = figure(ax, (7.5, 4.2))
    impls = sorted({r["impl"] for r in results.select(op=op) if r["shape"]["D"] == 128 and not is_sweep(r["impl"])})
    for impl in impls:
        recs = sorted((r for r in results.select(op=op, impl=impl) if r["shape"]["D"] == 128
                       and r["shape"]["causal"] == causal and r["shape"]["H"] == 32 and r["shape"]["B"] * r["shape"]["N"] == 16384),
                      key=lambda r: r["shape"]["N"])
        ok = [r for r in recs if r["us"] is not None]
        color = IMPL_COLORS[impl]
        ax.plot([r["shape"]["N"] for r in ok], [r["tflops"] for r in ok], "o-", label=impl, color=color)
        for r in recs:
            if r["us"] is None:
                ax.plot([r["shape"]["N"]], [0], "x", color=color, ms=10)
    ax.set_xscale("log", base=2)
    plain_log_ticks(ax)
    ax.set_xlabel("sequence length N (batch x N = 16k tokens, 32 heads, D=128)")
    ax.set_ylabel(f"TFLOP/s ({op})")
    ax.set_title(f"Attention {op}, {'causal' if causal else 'full'} (x at 0: out of memory or refused)")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.2)
    return finish(fig, results.provenance())

FORWARD_BUDGET = (  # (impl of an Op.FORWARD_VARIANT record, label, colour)
    (Impl.MATMULS_ONLY, "the loop's matrix products alone\n(softmax removed: not attention)", "#6baed6"),
    (Impl.LOOP_COPY, "the whole loop\n(a copy of lessonlib's)", IMPL_COLORS[Impl.LESSONLIB]),
    (Impl.LAZY_RESCALE, "... rescaling only when the\nmaximum grows by > 2^8", "#a1d99b"),
    (Impl.EXP2_16BIT, "... exp2 in 16 bits\n(2 per instruction)", "#a1d99b"),
)

def forward_time_budget(results: Results, shape: dict, ax=None):
    """Where the forward's time goes, from one recorded run: the time its FLOPs take at the measured matmul rate, the
    benchmark's copies of lessonlib's loop changed one way at a time (``op=Op.FORWARD_VARIANT``), and cuDNN."""
    fig, ax = figure(ax, (WIDTH, 4.4))
    flops = 4 * shape["B"] * shape["H"] * shape["N"] ** 2 * shape["D"]
    rows = [("its FLOPs at the measured\nmatmul rate (cuBLAS)", flops / (results.ceilings["matmul_tflops"] * 1e12) * 1e6,
             "#bdbdbd")]
    rows += [(label, results.one(op=Op.FORWARD_VARIANT, impl=impl, **shape)["us"], color)
             for impl, label, color in FORWARD_BUDGET]
    rows += [("cuDNN (SDPA)", r["us"], IMPL_COLORS[Impl.SDPA_CUDNN]) for r in results.select(op=Op.FORWARD, impl=Impl.SDPA_CUDNN, **shape)]
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
    return finish(fig, results.provenance())


def launch_bound_attention(results: Results, footnote: str | None = None):
    """Attention at tiny T (``lessonlib.cases.attention_launches``): above, time per call of each implementation,
    back to back (solid, launches included) and replayed from a CUDA graph (dashed, the GPU's work alone), each
    labelled with the kernels one call launches, read from the records (SDPA's count changes with T); below, the
    time cut by fusion, 1 - fused / eager, with the news
    item's 70% as a line. ``footnote``: the provenance (default: the results file's)."""
    from lessonlib.cases.attention_launches import launch_counts, launches_text, time_cuts

    records = results.select(op=Op.LAUNCH_BOUND_ATTENTION)
    impls = list(dict.fromkeys(r["impl"] for r in records))
    # stacked, the legends right of the axes: side by side at the output's width, they covered the curves
    fig, (times, cuts) = plt.subplots(2, 1, figsize=(WIDTH, 7.6))
    for impl in impls:
        rows = sorted((r for r in records if r["impl"] == impl and r["us"] is not None), key=lambda r: r["shape"]["T"])
        color = IMPL_COLORS.get(impl, "black")
        t = [r["shape"]["T"] for r in rows]
        times.plot(t, [r["us"] for r in rows], "o-", color=color,
                   label=f"{impl} ({launches_text(launch_counts(results, impl))})")
        graphed = [(r["shape"]["T"], r["graph_us"]) for r in rows if r.get("graph_us") is not None]
        if graphed:
            times.plot(*zip(*graphed), "s--", color=color, alpha=0.6, ms=4)
        if impl != Impl.EAGER_ATTENTION:
            for field, style in (("us", "o-"), ("graph_us", "s--")):
                cut = time_cuts(results, impl, field)
                if cut:
                    cuts.plot(list(cut), [100 * c for c in cut.values()], style, color=color,
                              label=f"{impl}, {'back to back' if field == 'us' else 'graph replay (GPU alone)'}")
    times.plot([], [], "k-", label="solid: per call, back to back")
    times.plot([], [], "k--", alpha=0.6, label="dashed: replayed from a CUDA graph")
    times.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="µs per call")
    shape = records[0]["shape"]
    times.set_title(f"B={shape['B']}, H={shape['H']}, D={shape['D']}, causal: time per call", fontsize=10)
    times.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    cuts.axhline(70, color="black", ls=":", lw=1.2, label="the news item: up to 70%")
    cuts.set(xscale="log", xlabel="sequence length T", ylabel="time cut by fusion, % (1 - fused / eager)")
    eager = launches_text(launch_counts(results, Impl.EAGER_ATTENTION))
    cuts.set_title(f"what fusing saves over eager's {eager}", fontsize=10)
    cuts.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    lengths = sorted({r["shape"]["T"] for r in records})
    for ax in (times, cuts):
        ax.grid(True, which="both", alpha=0.2)
        plain_log_ticks(ax)
        ax.set_xticks(lengths, [str(t) for t in lengths])
    return finish(fig, footnote or results.provenance(), bottom=0.05)
