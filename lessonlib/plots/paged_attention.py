"""Lessons 03 and 06: block tables, KV memory reserved, recorded paged-attention speed."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from lessonlib.results import Impl, Op, Results
from lessonlib.plots._figure import IMPL_COLORS, WIDTH, figure, finish
from lessonlib.plots.recorded import RUN_COLORS


def block_tables(panels: dict[str, dict[str, list[int]]], ref_counts: dict[str, dict[int, int]] | None = None):
    """Block tables side by side, one panel per block manager: a row per sequence, a box per logical block
    labelled with its physical block id. A block two sequences share is drawn in the same colour in both rows and
    outlined in black (its reference count is above 1)."""
    ref_counts = ref_counts or {}
    fig, axes = plt.subplots(1, len(panels), figsize=(min(WIDTH, 4.1 * len(panels)), 0.8 + 0.75 * max(len(t) for t in panels.values())),
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
    return finish(fig)

def kv_reservation(lengths, reservation, bytes_per_token: int, max_len: int, block_size: int):
    """Left: how long the requests are. Right: KV memory used vs held by paged blocks vs reserved as slabs."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(WIDTH, 3.8), gridspec_kw={"width_ratios": [1.1, 1]})
    left.hist(np.asarray(lengths), bins=40, color="#9ecae1")
    left.axvline(max_len, color=IMPL_COLORS[Impl.EAGER], ls="--")
    left.text(max_len, left.get_ylim()[1] * 0.9, f" max_len {max_len:,}", color=IMPL_COLORS[Impl.EAGER], fontsize=8,
              ha="right" if max_len > np.asarray(lengths).max() * 0.7 else "left")
    left.set_xlabel("tokens per request (prompt + output)")
    left.set_ylabel("requests")
    left.set_title(f"{len(lengths)} requests, median {int(np.median(np.asarray(lengths))):,} tokens", fontsize=10)
    gb = [t * bytes_per_token / 1e9 for t in (reservation.used_tokens, reservation.paged_tokens,
                                              reservation.contiguous_tokens)]
    labels = ["used\n(every\ntoken's K, V)", f"paged\n(blocks\nof {block_size})", f"contiguous\n(slab of\n{max_len:,})"]
    bars = right.bar(labels, gb, color=["#74c476", IMPL_COLORS[Impl.LESSONLIB], IMPL_COLORS[Impl.EAGER]])
    for bar, value, waste in zip(bars, gb, (0.0, reservation.paged_waste, reservation.contiguous_waste)):
        right.text(bar.get_x() + bar.get_width() / 2, value, f"{value:,.1f} GB\n{waste:.0%} unused", ha="center",
                   va="bottom", fontsize=8)
    right.set_ylabel("KV cache memory, GB")
    right.set_ylim(0, max(gb) * 1.25)
    right.set_title("memory held for the same requests", fontsize=10)
    return finish(fig)

def paged_attention_speed(results: Results, ax=None):
    """Decode attention GB/s per shape: lessonlib's paged kernel against SDPA on a contiguous cache, gather+SDPA and
    FlexAttention's paged attention. GPU time (each call replayed from a CUDA graph) where the run recorded it."""
    fig, ax = figure(ax, (WIDTH, 4.2))
    impls = [Impl.LESSONLIB, Impl.SDPA_CONTIGUOUS, Impl.GATHER_THEN_SDPA, Impl.FLEX_PAGED]
    colours = [IMPL_COLORS.get(i) or RUN_COLORS[i] for i in impls]  # the colours of lesson 03's recorded view
    shapes = []
    for rec in results.select(op=Op.PAGED_ATTENTION, impl=Impl.LESSONLIB):
        key = (rec["shape"]["B"], rec["shape"]["context"])
        if key not in shapes:
            shapes.append(key)
    graph_timed = any(r.get("graph_gbps") for r in results.select(op=Op.PAGED_ATTENTION))
    width = 0.8 / len(impls)
    for i, (impl, colour) in enumerate(zip(impls, colours)):
        xs = np.arange(len(shapes)) + (i - (len(impls) - 1) / 2) * width
        for x, (b, c) in zip(xs, shapes):
            found = results.select(op=Op.PAGED_ATTENTION, impl=impl, B=b, context=c)
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
    return finish(fig, results.provenance())


def paging_payoff(results: Results, footnote: str | None = None):
    """The same KV memory reserved two ways (``lessonlib.cases.paging_payoff``): left, the largest batch that fits;
    right, the decode tokens/s the engine reached at that batch, the median run with a whisker from the slowest
    to the fastest. ``footnote``: the provenance (default: the results file's)."""
    rows = {r["impl"]: r for r in results.select(op=Op.LARGEST_BATCH)}
    impls = [i for i in (Impl.KV_SLABS, Impl.KV_BLOCKS) if i in rows]
    colors = {Impl.KV_SLABS: IMPL_COLORS[Impl.EAGER], Impl.KV_BLOCKS: IMPL_COLORS[Impl.LESSONLIB]}
    fig, (fit, rate) = plt.subplots(1, 2, figsize=(WIDTH, 4.2))
    labels = [i.replace(" (", "\n(") for i in impls]
    fit.bar(labels, [rows[i]["batch"] for i in impls], color=[colors[i] for i in impls])
    for x, impl in enumerate(impls):
        r = rows[impl]
        held = "all reserved" if impl == Impl.KV_SLABS else "held"
        # Three short lines, within the bar's width: a wider label passes the axes and widens the figure.
        fit.text(x, r["batch"], f"{r['batch']} sequences, using\n{r['kv_blocks_needed']:,} of the "
                 f"{r['shape']['pool_blocks']:,}\nblocks' slots ({held})", ha="center", va="bottom", fontsize=8)
    fit.set_ylabel("sequences decoding at once")
    fit.set_ylim(top=max(rows[i]["batch"] for i in impls) * 1.3)
    shape = rows[impls[0]]["shape"]
    fit.set_title(f"largest batch in a pool of {shape['pool_blocks']:,} blocks of {shape['block_size']} tokens\n"
                  f"(max_model_len {shape['max_model_len']:,})", fontsize=9)  # two lines: one would pass its axes
    values = [rows[i]["decode_tokens_per_s"] for i in impls]
    spread = [[v - rows[i]["decode_tokens_per_s_min"] for v, i in zip(values, impls)],
              [rows[i]["decode_tokens_per_s_max"] - v for v, i in zip(values, impls)]]
    rate.bar(labels, values, color=[colors[i] for i in impls], yerr=spread, capsize=5, ecolor="black")
    for x, (value, above) in enumerate(zip(values, spread[1])):
        rate.text(x, value + above, f"{value:,.1f}", ha="center", va="bottom", fontsize=8)
    rate.set_ylabel("decode tokens/s (all sequences)")
    rate.set_ylim(top=max(values) * 1.2)
    runs = rows[impls[0]]["repeats"]
    rate.set_title(f"decode tokens/s at that batch: median of {runs} runs,\nwhisker slowest to fastest", fontsize=9)
    return finish(fig, footnote or results.provenance(), bottom=0.08)
