"""Lesson 07: the servers under Poisson traffic (``benchmarks/bench_serving.py``), latency against request rate."""

from __future__ import annotations

import matplotlib.pyplot as plt

from lessonlib.results import Impl, Op, Results
from lessonlib.plots._figure import finish, plain_log_ticks

SERVER_COLORS = {Impl.SERVER_CHUNKED_PREFILL: "#2ca02c", Impl.SERVER_NO_CHUNKED_PREFILL: "#98df8a",
                 Impl.HF_SERVE: "#ff7f0e"}
PANELS = (("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token latency (ms)"),
          ("e2e_ms", "end-to-end latency (ms)"), ("output_tokens_per_s", "output tokens/s"))


def serving_latency(results: Results, workload: str = "random", footnote: str | None = None):
    """One panel per measure against the request rate, a line per server: the p50 solid with the p99 dashed above
    it (latencies), and output tokens/s. A server recorded with an error is named in the legend with it."""
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 4.0))
    rows = results.select(op=Op.SERVING)
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
        if failed and not measured:
            axes[-1].plot([], [], color=color, label=f"{impl}: {failed[:60]}")
    for ax, (_, label) in zip(axes, PANELS):
        ax.set_xscale("log")
        plain_log_ticks(ax)
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"servers under load, {workload} prompts", fontsize=10)
    return finish(fig, footnote if footnote is not None else results.provenance(), bottom=0.08)
