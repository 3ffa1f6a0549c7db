"""Lesson 07: the servers under Poisson traffic (``benchmarks/bench_serving.py``), latency against request rate."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from lessonlib.results import Impl, Op, Results
from lessonlib.plots._figure import finish, plain_log_ticks
from lessonlib.plots.serving_engine import MODE_COLORS

# Chunked prefill and prefill-first in the chunked-prefill timeline's colours (one meaning per colour in lesson 07).
SERVER_COLORS = {Impl.SERVER_CHUNKED_PREFILL: MODE_COLORS[Impl.CHUNKED_PREFILL],
                 Impl.SERVER_NO_CHUNKED_PREFILL: MODE_COLORS[Impl.PREFILL_FIRST], Impl.HF_SERVE: "#ff7f0e"}
PANELS = (("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token latency (ms)"),
          ("e2e_ms", "end-to-end latency (ms)"), ("output_tokens_per_s", "output tokens/s"))


def serving_latency(results: Results, workload: str = "random", footnote: str | None = None):
    """One panel per measure against the request rate, a line per server: the p50 solid with the p99 dashed above
    it (latencies), and output tokens/s. A server recorded with an error is named in the legend with it."""
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 4.0))
    rows = results.select(op=Op.SERVING)
    servers = []  # one legend entry per server (its error where it failed), below the panels
    for impl, color in SERVER_COLORS.items():
        measured = sorted((r for r in rows if r["impl"] == impl and r["shape"].get("workload") == workload
                           and "error" not in r), key=lambda r: r["shape"]["rate"])
        failed = next((r["error"] for r in rows if r["impl"] == impl and "error" in r), None)
        for ax, (key, _) in zip(axes, PANELS if measured else ()):
            rates = [r["shape"]["rate"] for r in measured]
            if key == "output_tokens_per_s":
                ax.plot(rates, [r[key] for r in measured], "o-", color=color, label=impl)
                continue
            ax.plot(rates, [r[key]["p50"] for r in measured], "o-", color=color, label=f"{impl} p50")
            ax.plot(rates, [r[key]["p99"] for r in measured], "^--", color=color, label=f"{impl} p99")
        if measured or failed:
            servers.append(Line2D([], [], color=color, marker="o", label=impl if measured else f"{impl}: {failed[:60]}"))
    for ax, (_, label) in zip(axes, PANELS):
        ax.set_xscale("log")
        plain_log_ticks(ax)
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    styles = [Line2D([], [], color="grey", marker="o", label="p50 (solid)"),
              Line2D([], [], color="grey", marker="^", linestyle="--", label="p99 (dashed)")]
    fig.legend(handles=servers + styles, loc="lower center", ncol=len(servers) + 2, fontsize=8,
               bbox_to_anchor=(0.5, 0.07), frameon=False)
    fig.suptitle(f"servers under load, {workload} prompts", fontsize=10)
    return finish(fig, footnote if footnote is not None else results.provenance(), bottom=0.24)
