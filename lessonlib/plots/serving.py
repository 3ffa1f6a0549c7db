"""Lesson 07: the servers under Poisson traffic (``benchmarks/bench_serving.py``), latency against request rate."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from lessonlib.results import Impl, Op, Results
from lessonlib.plots._figure import WIDTH, finish, plain_log_ticks
from lessonlib.plots.serving_engine import MODE_COLORS

# Chunked prefill and prefill-first in the chunked-prefill timeline's colours (one meaning per colour in lesson 07).
SERVER_COLORS = {Impl.SERVER_CHUNKED_PREFILL: MODE_COLORS[Impl.CHUNKED_PREFILL],
                 Impl.SERVER_NO_CHUNKED_PREFILL: MODE_COLORS[Impl.PREFILL_FIRST], Impl.HF_SERVE: "#ff7f0e"}
PANELS = (("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token latency (ms)"),
          ("e2e_ms", "end-to-end latency (ms)"), ("output_tokens_per_s", "output tokens/s"))


def serving_latency(results: Results, workload: str = "random", footnote: str | None = None):
    """One panel per measure against the request rate, a line per server: the p50 solid with the p99 dashed above
    it (latencies), and output tokens/s. A server recorded with an error is named in the legend with it."""
    fig, grid = plt.subplots(2, 2, figsize=(WIDTH, 7.2))  # four panels, two by two: each wide enough to read
    axes = list(grid.flat)
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
    for ax, (key, label) in zip(axes, PANELS):
        ax.set_xscale("log")
        if key != "output_tokens_per_s":  # past a knee the p99s grow by orders of magnitude: low rates stay readable
            ax.set_yscale("log")
            label = label.replace("(ms)", "(ms, log scale)")
        plain_log_ticks(ax)
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    styles = [Line2D([], [], color="grey", marker="o", label="p50 (solid)"),
              Line2D([], [], color="grey", marker="^", linestyle="--", label="p99 (dashed)")]
    knee_s = results.notes.get("targets", {}).get("ttft_knee_s")
    if knee_s is not None:  # the limit that defines each server's knee (serving_summary prints each server's)
        axes[0].axhline(1e3 * knee_s, color="black", linestyle=":", linewidth=1)
        styles.append(Line2D([], [], color="black", linestyle=":", label=f"knee: p99 TTFT {knee_s:g} s"))
    fig.legend(handles=servers + styles, loc="lower center", ncol=3, fontsize=8,
               bbox_to_anchor=(0.5, 0.035), frameon=False)
    fig.suptitle(f"servers under load, {workload} prompts", fontsize=10)
    return finish(fig, footnote if footnote is not None else results.provenance(), bottom=0.13)


def serving_summary(results: Results) -> str:
    """The run's comparison of the servers, in words, from ``notes["targets"]`` (computed by bench_serving.py from its
    random-workload records): each server's knee, each of this server's schedules against transformers' (knee over
    knee, and p99 TTFT and ITL at transformers' knee rate), and chunked prefill's output tokens/s at saturation over
    prefill-first's. A knee no rate was past is a lower bound, and a ratio over it is said to be one."""
    notes = results.notes["targets"]
    ran = {r["impl"] for r in results.select(op=Op.SERVING) if r["shape"].get("workload") == "random"
           and "error" not in r}
    reached = notes.get("knee_reached", {})
    lines = [f"each server's knee, the highest request rate whose p99 time to first token stays under "
             f"{notes['ttft_knee_s']:g} s:"]
    lines += [f"  {server:42s} {_rate(rate, reached.get(server) is not False) if server in ran else _NOT_RUN}"
              for server, rate in notes["knee_rate"].items()]
    peer_rate = notes["knee_rate"].get(Impl.HF_SERVE)
    at = f", {peer_rate:g} requests/s" if peer_rate is not None else ""
    lines.append(f"over transformers' server: the knee; the p99 TTFT and ITL at its knee rate{at}:")
    for server in (Impl.SERVER_CHUNKED_PREFILL, Impl.SERVER_NO_CHUNKED_PREFILL):
        verdict = notes[server]
        p99 = verdict.get("p99_over_peer_at_peer_knee", {})
        lines.append(f"  {server:42s} knee {_knee_ratio(verdict['knee_rate_over_peer'], reached, server)}; "
                     f"TTFT {_times(p99.get('ttft_ms'))}, ITL {_times(p99.get('itl_ms'))}")
    lines.append(f"output tokens/s at saturation (the most at any rate), chunked prefill over prefill-first: "
                 f"{_times(notes['saturation_chunked_over_prefill_first'])}")
    return "\n".join(lines)


def _knee_ratio(ratio: float | None, reached: dict, server: str) -> str:
    """Knee over transformers' knee: at least (our knee a lower bound), at most (its knee a lower bound), or
    undecided (both)."""
    ours, peer = reached.get(server) is False, reached.get(Impl.HF_SERVE) is False
    if ratio is None or (ours and peer):
        return "not measured" if ratio is None else "undecided (neither knee was reached)"
    return ("at least " if ours else "at most " if peer else "") + f"{ratio:.2f}x"


_NOT_RUN = "not measured (its error: in the figure)"


def _rate(rate: float | None, reached: bool = True) -> str:
    if rate is None:
        return "none: even the lowest rate is past it"
    return f"{rate:g} requests/s" if reached else f"at least {rate:g} requests/s (its time ran out first)"


def _times(ratio: float | None) -> str:
    return "not measured" if ratio is None else f"{ratio:.2f}x"
