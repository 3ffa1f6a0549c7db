"""What lesson 07 draws: the scheduler under a stream of arriving requests
(:func:`lessonlib.cases.serving_engine.simulate`), an engine run's step timeline, the recorded GPU run
(``lessonlib/results/engine-h200.json``) and its tokens/s ladder, and one long prompt arriving among decodes with and
without chunked prefill (:mod:`lessonlib.cases.chunked_prefill`)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from lessonlib.plots._figure import IMPL_COLORS, WIDTH, figure, finish, plain_log_ticks
from lessonlib.results import Impl, Op, Results


def plot_simulation(records: list, num_blocks: int, axes=None):
    """Two panels over the same steps (``records``: :func:`lessonlib.cases.serving_engine.simulate`): KV blocks in
    use against what up-front reservation would hold (above), and the requests running and waiting (below). Blocks
    and requests each get an axis of their own: drawn on one axis and its twin, nothing said which scale a line was
    read on. Returns the two axes."""
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(WIDTH, 5.4), sharex=True, gridspec_kw={"height_ratios": (3, 2)})
    blocks, queue = axes
    steps = [r.step for r in records]
    blocks.plot(steps, [r.blocks_reserved for r in records], color="tab:gray", lw=1.5,
                label="reserved up front\n(each request's max length)")
    blocks.plot(steps, [r.blocks_used for r in records], color="tab:blue", lw=2, label="in use (paged)")
    blocks.axhline(num_blocks, color="black", lw=0.9, ls="--", label=f"the pool: {num_blocks} blocks")
    blocks.set_ylabel("KV blocks")
    last = records[-1]
    blocks.set_title(f"KV blocks held as requests arrive, paged against reserved up front\n{last.preemptions} "
                     f"preemptions, {last.cached_tokens:,} prompt tokens from the prefix cache", fontsize=10)
    queue.step(steps, [r.running for r in records], where="post", color="tab:green", lw=1.5, label="running")
    queue.fill_between(steps, [r.waiting for r in records], step="post", color="tab:red", alpha=0.35, lw=0,
                       label="waiting")
    queue.set_ylabel("requests")
    queue.set_xlabel("engine step")
    queue.set_ylim(bottom=0)
    for ax in axes:  # beside the axes, not on the curves
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False)
        ax.grid(True, axis="y", alpha=0.25)
    blocks.figure.tight_layout()
    return axes


def plot_steps(steps, ax=None, label: str = "interpreter time (CPU, not performance)"):
    """An engine run's steps (``LLM.steps``): time per step, prefill and decode coloured apart."""
    _, ax = figure(ax, (WIDTH, 3))
    colors = ["tab:orange" if s.kind == "prefill" else "tab:blue" for s in steps]
    ax.bar(range(len(steps)), [1e3 * s.seconds for s in steps], color=colors)
    ax.set_xlabel("engine step (orange: prefill, blue: decode)")
    ax.set_ylabel(f"ms ({label})")
    for i, s in enumerate(steps):
        ax.text(i, 1e3 * s.seconds, str(s.num_seqs), ha="center", va="bottom", fontsize=7)
    ax.set_title("step timeline; the number over each bar is the batch size")
    return ax


# The step's parts in purples and greys: the left panel's colours are implementations (IMPL_COLORS), and a blue
# "attention" beside a blue "transformers generate" would read as one thing.
PART_COLORS = {"attention": "#3f007d", "mlp": "#6a51a3", "norms": "#9e9ac8", "embedding and output head": "#cbc9e2",
               "sampling (greedy)": "#525252", "host": "#bdbdbd"}
_MORE_PART_COLORS = ("#807dba", "#dadaeb", "#969696", "#737373")


def plot_recorded(results, axes=None):
    """The recorded GPU run: tokens/s of every peer at each batch size, and one decode step split into parts
    against the bytes-read limit."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(WIDTH, 4.4))
    ladder, parts = axes
    _plot_tokens_per_s(results, ladder)
    _plot_step_parts(results, parts)
    finish(ladder.figure, results.provenance())
    return axes


def _plot_tokens_per_s(results, ax) -> None:
    generate = results.select(op=Op.GENERATE)
    impls = list(dict.fromkeys(r["impl"] for r in generate))
    batches = sorted({r["shape"]["batch"] for r in generate})
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        values = [next((r["tokens_per_s"] for r in generate if r["impl"] == impl and r["shape"]["batch"] == b), 0)
                  for b in batches]
        ax.bar([x + i * width for x in range(len(batches))], values, width, label=impl, color=IMPL_COLORS[impl])
    limit = results.notes.get("weight_read_limit_tokens_per_s_batch_1")
    if limit and 1 in batches:  # the weights read once per step: a bound at batch 1 only (more rows share the read)
        at = batches.index(1)
        ax.hlines(limit, at - width / 2, at + 0.8 - width / 2, color="black", ls="--", lw=1.2,
                  label="weight-read limit (batch 1)")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylim(top=max(r["tokens_per_s"] for r in generate) * 12)  # room above the bars for the legend
    ax.set_ylabel("tokens/s (log scale)")
    ax.set_title("tokens/s, 128-token prompts, 128 new tokens; colour: implementation", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def _plot_step_parts(results, ax) -> None:
    rows = results.select(op=Op.DECODE_STEP_PART)
    batches = sorted({r["shape"]["batch"] for r in rows})
    shown = [p for p in dict.fromkeys(r["part"] for r in rows) if p != "whole step"]
    bottoms = [0.0] * len(batches)
    for n, part in enumerate(shown):
        values = [next((r["us"] for r in rows if r["part"] == part and r["shape"]["batch"] == b), 0) for b in batches]
        ax.bar(range(len(batches)), values, bottom=bottoms, label=part, edgecolor="white", lw=0.5,
               color=PART_COLORS.get(part, _MORE_PART_COLORS[n % len(_MORE_PART_COLORS)]))
        bottoms = [a + b for a, b in zip(bottoms, values)]
    limits = [next((r["us"] for r in results.select(op=Op.DECODE_STEP_LIMIT) if r["shape"]["batch"] == b), None)
              for b in batches]
    drawn = [(x, limit) for x, limit in enumerate(limits) if limit is not None]
    for n, (x, limit) in enumerate(drawn):  # black dashed, as the left panel's weight-read limit: a limit
        ax.hlines(limit, x - 0.45, x + 0.45, color="black", ls="--", lw=1.5, zorder=3,
                  label="bytes-read limit" if n == 0 else None)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("µs per decode step")
    ax.set_ylim(0, max(bottoms + [l or 0 for l in limits]) * 1.6)  # room above the bars for the legend
    ax.set_title("one decode step (CUDA graphs) by part, against the bytes it must read;\ncolour: part of the step",
                 fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="upper left")


def batch_1_summary(results) -> str:
    """The recorded batch-1 run in two lines: tokens/s against the weight-read limit, and one decode step's wall time
    with and without asynchronous scheduling against its GPU time."""
    def record(op, impl, part=None):
        return next((r for r in results.select(op=op) if r["impl"] == impl and r["shape"]["batch"] == 1
                     and r.get("part") == part), None)

    engine = record(Op.GENERATE, Impl.ENGINE_GRAPHS)
    ahead, sync = record(Op.ENGINE_STEPS, Impl.ENGINE_GRAPHS), record(Op.ENGINE_STEPS, Impl.ENGINE_GRAPHS_SYNC)
    gpu = record(Op.DECODE_STEP_PART, Impl.ENGINE, part="whole step")
    limit = results.notes.get("weight_read_limit_tokens_per_s_batch_1")
    if any(r is None for r in (engine, ahead, sync, gpu, limit)):
        return "this results file predates asynchronous scheduling: no batch-1 summary"
    return (f"batch 1: {engine['tokens_per_s']:,.0f} tokens/s, {engine['tokens_per_s'] / limit:.2f}x the "
            f"weight-read limit ({limit:,.0f} tokens/s)\n"
            f"one decode step: {ahead['decode_step_us']:,.0f} µs of wall time with asynchronous scheduling, "
            f"{sync['decode_step_us']:,.0f} µs with the host\n"
            f"  waiting for each step's tokens; the step's GPU time alone: {gpu['us']:,.0f} µs")


def fused_decode_summary(results) -> str:
    """The batch-1 decode step with ``Features.fused_decode_layer`` off and on, from bench_engine.py's records: kernels
    per layer (the profiler's count of one layer) and, where timed, the step's GPU time against its bytes-read limit;
    "" for a file that predates them."""
    steps = {r["fused_decode_layer"]: r for r in results.select(op=Op.BATCH_1_DECODE_STEP)}
    if set(steps) != {False, True}:
        return ""
    off, on = steps[False], steps[True]
    text = (f"batch-1 decode step, Features.fused_decode_layer off / on: {off['kernels_per_layer']} / "
            f"{on['kernels_per_layer']} kernels per layer")
    if off["gpu_us"] is not None and on["gpu_us"] is not None:  # a second line: printed lines stay under 100 wide
        text += (f";\n  GPU time per step {off['gpu_us']:,.0f} / {on['gpu_us']:,.0f} µs against a bytes-read limit "
                 f"of {on['limit_us']:,.0f} µs ({off['fraction_of_limit']:.2f}x / {on['fraction_of_limit']:.2f}x)")
    return text


def ladder_records(results) -> list[dict]:
    """The recorded tokens/s ladder, in rung order; [] when the file predates it."""
    return results.select(op=Op.LADDER) if results is not None else []


def ladder_gain(row: dict, below: dict) -> str:
    """A rung's gain over the rung below, "×1.76", and whether it stands above the runs' spread: a verdict only
    where the slower rung's fastest run is slower than the faster rung's slowest (a file from before the repeats
    holds one run per rung: no verdict)."""
    gain = f"×{row['tokens_per_s'] / below['tokens_per_s']:.2f}"
    if "tokens_per_s_min" not in row or "tokens_per_s_min" not in below:
        return gain + " (one run: no verdict)"
    faster = row["tokens_per_s_min"] > below["tokens_per_s_max"]
    slower = row["tokens_per_s_max"] < below["tokens_per_s_min"]
    if faster or slower:
        return gain + f" ({'faster' if faster else 'slower'}, beyond the spread)"
    return gain + " (within the spread)"


def ladder_provenance(results) -> str:
    """The ladder's own run (``bench_engine.py --ladder-only`` records it apart) or the file's."""
    own = results.notes.get("ladder", {}).get("provenance")
    if not own:
        return results.provenance()
    return (f"ladder recorded on {own['gpu']}, torch {own['torch']}, triton {own['triton']}, {own['date'][:10]}; "
            f"command: {own['command']}")


def plot_ladder(results, ax=None):
    """The recorded tokens/s ladder. Above: one bar per rung, the median run's tokens/s, its whisker the slowest to
    the fastest run, labelled with its gain over the rung below and whether that gain stands above the spread; a
    black diamond at the tokens/s the GPU's kernel time alone would give. Below (without ``ax``): time per step,
    wall (median run) against the GPU's kernel time. Log scales: the rungs span orders of magnitude. Returns the
    tokens/s axis."""
    rows = ladder_records(results)
    if not rows:
        raise ValueError("this results file has no tokens/s ladder: run python benchmarks/bench_engine.py --out ...")
    if ax is None:
        # stacked: side by side at the output's width, the rungs' labels ran into each other
        fig, (ax, steps) = plt.subplots(2, 1, figsize=(WIDTH, 10), gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, steps = ax.figure, None
    x = range(len(rows))
    values = [r["tokens_per_s"] for r in rows]
    spread = [[v - r.get("tokens_per_s_min", v) for v, r in zip(values, rows)],
              [r.get("tokens_per_s_max", v) - v for v, r in zip(values, rows)]]
    runs = rows[0].get("repeats", 1)
    ax.bar(x, values, color=WALL_COLOR, yerr=spread, capsize=4, ecolor="black",
           label=f"wall clock: median of {runs} runs, whisker slowest to fastest" if runs > 1 else
           "wall clock: one run (this file records no spread)")
    gpu = [(i, r["gpu_tokens_per_s"]) for i, r in enumerate(rows) if r.get("gpu_tokens_per_s")]
    if gpu:
        ax.plot(*zip(*gpu), "D", color=GPU_COLOR, label="tokens / GPU kernel time (the host's cost left out)")
    for i, value in enumerate(values):
        gain = "" if i == 0 else "\n" + ladder_gain(rows[i], rows[i - 1]).replace(" (", "\n(")
        ax.text(i, value * 1.15, f"{value:,.0f}{gain}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [r["impl"] for r in rows], rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(top=max(values + [g for _, g in gpu]) * 30)  # room for the labels and the legend
    ax.set_ylabel("output tokens/s (log scale)")
    s = rows[0]["shape"]
    ax.set_title(f"tokens/s ladder: {s['requests']} requests, {s['max_num_seqs']} seats,\n{s['prompt']}-token prompts, "
                 f"{s['max_tokens_low']}-{s['max_tokens_high']} new tokens each", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    plain_log_ticks(ax)
    if steps is not None:
        plot_ladder_steps(rows, steps)
        plain_log_ticks(steps)
    finish(fig, ladder_provenance(results), bottom=0.04)
    return ax


WALL_COLOR, GPU_COLOR = "tab:blue", "black"  # the same meaning in both panels of the ladder's figure


def plot_ladder_steps(rows: list[dict], ax) -> None:
    """Time per step of each rung: wall clock (the median run's seconds over its steps) beside the GPU's kernel
    time per step, where recorded."""
    width = 0.4
    wall = [r.get("wall_us_per_step", 1e6 * r["seconds"] / (r["prefill_steps"] + r["decode_steps"])) for r in rows]
    ax.bar([i - width / 2 for i in range(len(rows))], wall, width, color=WALL_COLOR, label="wall clock, per step")
    gpu = [(i + width / 2, r["gpu_us_per_step"]) for i, r in enumerate(rows) if r.get("gpu_us_per_step")]
    if gpu:
        ax.bar(*zip(*gpu), width, color=GPU_COLOR, alpha=0.75, label="GPU kernel time, per step")
    else:
        ax.text(0.5, 0.02, "GPU time per step: not recorded in this file", transform=ax.transAxes, ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["impl"] for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("µs per engine step (log scale)")
    ax.set_title("where a step's time goes: the host, or the GPU's kernels", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")


MODE_COLORS = {Impl.PREFILL_FIRST: IMPL_COLORS[Impl.EAGER], Impl.CHUNKED_PREFILL: IMPL_COLORS[Impl.LESSONLIB]}


def chunked_prefill_timeline(results: Results, footnote: str | None = None):
    """One long prompt arriving among running decodes (``lessonlib.cases.chunked_prefill``). Top: each mode's steps
    on a time line from the prompt's arrival, a box per step, green when the decodes got a token from it, grey when
    they waited, a star at the prompt's first token. Bottom: the decodes' inter-token gaps, each drawn at the token
    that ends it. ``footnote``: the provenance (default: the results file's)."""
    from lessonlib.cases.chunked_prefill import decode_gaps

    rows = {r["impl"]: r for r in results.select(op=Op.STEP_TIMELINE)}
    modes = [m for m in (Impl.PREFILL_FIRST, Impl.CHUNKED_PREFILL) if m in rows]
    fig, (steps_ax, gaps_ax) = plt.subplots(2, 1, figsize=(WIDTH, 6), sharex=True, height_ratios=(1, 1.4))
    end = max(s["end"] for mode in modes for s in rows[mode]["steps"])
    for y, mode in enumerate(reversed(modes)):
        rec = rows[mode]
        boxes = [(s["end"] - s["seconds"], s["seconds"]) for s in rec["steps"]]
        colours = ["#2ca02c" if any(s["tokens"][:-1]) else "#bbbbbb" for s in rec["steps"]]
        steps_ax.broken_barh(boxes, (y - 0.35, 0.7), facecolors=colours, edgecolors="white", linewidth=1.5)
        steps_ax.plot(rec["ttft_s"], y + 0.42, marker="*", markersize=13, color=MODE_COLORS[mode], clip_on=False)
        label, left = f"first token of the long prompt: {rec['ttft_s']:.2f} s", rec["ttft_s"] > 0.6 * end
        steps_ax.text(rec["ttft_s"], y + 0.42, f"{label}  " if left else f"  {label}", ha="right" if left else "left",
                      va="center", fontsize=8)  # left of the star near the right edge: inside the axes
    steps_ax.set_yticks(range(len(modes)), [m.split(" (")[0] for m in reversed(modes)])
    steps_ax.set_ylim(-0.6, len(modes) - 0.2)
    steps_ax.set_title("engine steps after the long prompt arrives (green: the decodes got a token; grey: they "
                       "waited)", fontsize=9)
    top = 0.0
    for mode in modes:
        steps = rows[mode]["steps"]
        gaps = [1e3 * gap for gap in decode_gaps(steps)]
        ends = [s["end"] for s in steps if any(s["tokens"][:-1])]  # each gap drawn at the token that ends it
        gaps_ax.plot(ends, gaps, marker="o", color=MODE_COLORS[mode], label=f"{mode}: longest gap {max(gaps):.0f} ms")
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
