"""The figures in what lessonlib shows a student (legends, titles, tables, checker messages, hints, printed
verdicts), each with what makes it true: the same kinds as the notebooks' markdown (tests/prose_figures.py), with
the module's path in place of the notebook and no cell. A figure that code formats from the data needs no entry."""

from __future__ import annotations

from lessonlib import traffic
from lessonlib.results import Impl, Op
from tests.prose_figures import Given, Holds, Measured
from tests.prose_registry import backward_kernels, run, single

AXIS = "how to read the axis: a lower time is a faster run (a definition, not a comparison of data)"
WHISKER = "what the whisker spans: the slowest to the fastest of the runs (a definition)"


def eager_elementwise_shares() -> list[float]:
    """Eager silu·mul's share of eager's whole GatedMLP at every T the recorded run has (what fusion could save)."""
    fusion = run("fusion-h200")
    tokens = sorted({r["shape"]["T"] for r in fusion.select(op=Op.GATED_MLP, impl=Impl.EAGER)})
    return [fusion.one(op=Op.GATED_MLP, impl=Impl.SHARE_EAGER_SILU_MUL, T=t)["us"]
            / fusion.one(op=Op.GATED_MLP, impl=Impl.EAGER, T=t)["us"] for t in tokens]


def paged_shape(key: str):
    """One dimension of every paged-attention decode record the speed plot draws (a single value, or it fails)."""
    return single({r["shape"][key] for r in run("paged-attention-h200").select(op=Op.PAGED_ATTENTION)})


def two_launch_kernels() -> int:
    """Kernels of absmax_normalize's two-launch strategy in its traffic model (lessonlib.traffic)."""
    return traffic.absmax_normalize(1 << 20, strategy="two_launches").fused.launches


GENERATED = (
    Given("lessonlib/plots/cuda_graphs.py", "", "time relative to eager (lower is faster)", AXIS),
    Given("lessonlib/plots/flash_attention.py", "", "microseconds per forward (shorter is faster)", AXIS),
    Given("lessonlib/plots/flash_attention.py", "", "the news item: up to 70%",
          "the news item's claim, drawn as a reference line: \"cutting kernel launch overhead by up to 70%\""),
    Given("lessonlib/plots/fusion.py", "", "time relative to eager (lower is faster)", AXIS),
    Holds("lessonlib/plots/fusion.py", "", "the GEMMs dominate, fusion can only save the elementwise share",
          lambda: max(eager_elementwise_shares()) < 0.5,
          "eager silu·mul under half of eager's GatedMLP at every recorded T: the rest, the GEMMs, is most of it"),
    Measured("lessonlib/plots/paged_attention.py", "", "32 query heads over 8 KV heads, D=128, 16-token blocks",
             "over 8", lambda: paged_shape("Hkv")),
    Holds("lessonlib/plots/paged_attention.py", "", "32 query heads over 8 KV heads, D=128, 16-token blocks",
          lambda: (paged_shape("H"), paged_shape("D"), paged_shape("block_size")) == (32, 128, 16),
          "the recorded decode shapes' query heads, head size and block size"),
    Given("lessonlib/plots/paged_attention.py", "", "runs, whisker slowest to fastest", WHISKER),
    Given("lessonlib/plots/serving_engine.py", "", "runs, whisker slowest to fastest", WHISKER),
    Given("lessonlib/widgets/__init__.py", "", "fastest possible: eager",
          "the roofline's time floor, computed on that line: a definition (no kernel beats its bytes at the copy "
          "bandwidth or its FLOPs at the matmul rate)"),
    Holds("lessonlib/results.py", "", "two kernels: dK/dV, then dQ", lambda: backward_kernels() == ["dkdv", "dq"],
          "the recorded schedules run's backward tiles: one configuration per kernel, dK/dV then dQ"),
    Given("lessonlib/results.py", "", "one kernel, dQ by float32 atomics",
          "the atomic schedule's design (FlashAttention-2's first): dK, dV and dQ in one pass over the key tiles"),
    Measured("lessonlib/results.py", "", "lessonlib, two launches (the launch boundary is the barrier)",
             "two launches", two_launch_kernels),
    Measured("lessonlib/traffic.py", "", "two launches", "two launches", two_launch_kernels),
    Given("lessonlib/traffic.py", "", "neg(second half of", "rotate_half's definition: the second half of the head "
          "dimension, negated"),
)

def _gather_case() -> dict:
    """Lesson 03's predict-then-measure case (B=32, context 4096): paged attention and gather-then-SDPA, recorded."""
    from lessonlib import results

    run = results.load("paged-attention-h200")
    return {impl: run.one(op="paged_attention", impl=impl, B=32, context=4096)
            for impl in ("lessonlib", "gather pages, then SDPA")} | {"bandwidth": run.ceilings["bandwidth_gbs"]}


def _gather_fractions_of_copy() -> list[float]:
    """Paged attention's GB/s, and the gather path's three passes' GB/s, over the copy ceiling (graph-timed)."""
    case = _gather_case()
    paged, gather = case["lessonlib"], case["gather pages, then SDPA"]
    return [paged["graph_gbps"] / case["bandwidth"],
            3 * gather["bytes"] / (gather["graph_us"] * 1e-6) / 1e9 / case["bandwidth"]]


def _per_call_us(impl: str) -> float:
    from lessonlib import results

    return next(r["us"] for r in results.load("fusion-h200").select(op="launch_overhead", impl=impl))


def _launches(impl: str) -> int:
    """Kernels per call of ``impl`` in the recorded launch-bound attention run, one count for every shape."""
    from lessonlib import results

    counts = {r["launches"] for r in results.load("attention-launches-h200").select(impl=impl)}
    return counts.pop() if len(counts) == 1 else -1


def _paged_kv_heads() -> float:
    from lessonlib import results

    heads = {r["shape"]["Hkv"] for r in results.load("paged-attention-h200").select(op="paged_attention")}
    return heads.pop() if len(heads) == 1 else -1


# --- the claims table (lesson 05), lessons 03 and 05's plots -------------------------------------------------------

CLAIM = "a source text's claim under test, or the course's reading of it: the table's verdict column decides it"
LREST = (
    Given("lessonlib/claims/__init__.py", "-", "into one launch cuts the time", CLAIM),
    Given("lessonlib/claims/__init__.py", "-", "cutting kernel launch overhead by up to 70%", CLAIM),
    Given("lessonlib/claims/__init__.py", "-", ", by up to 70%", CLAIM),
    Measured("lessonlib/claims/__init__.py", "-", "eager attention's five kernels against one fused launch",
             "five kernels", lambda: _launches("eager: matmul, scale, mask, softmax, matmul")),
    Measured("lessonlib/claims/__init__.py", "-", "eager attention's five kernels against one fused launch",
             "one fused launch", lambda: _launches("lessonlib")),
    Given("lessonlib/claims/__init__.py", "-", "delivering another 10–15% latency reduction", CLAIM),
    Given("lessonlib/claims/__init__.py", "-", "cuts its time by another 10–15%", CLAIM),
    Given("lessonlib/claims/__init__.py", "-", "RoPE and the KV-cache write in one launch are faster than apply_rope",
          CLAIM),
    Given("lessonlib/claims/__init__.py", "-", "bias + activation + multiply in one kernel is faster than eager", CLAIM),
    Given("lessonlib/claims/__init__.py", "-", "dequantised inside the matmul is faster than F.linear", CLAIM),
    *(Given("lessonlib/claims/quotations.py", "-", phrase, "the news item's words, registered as a quotation")
      for phrase in ("cutting kernel launch overhead by up to 70%", "by up to 70%", "up to 70%",
                     "delivering another 10–15% latency reduction", "another 10–15%",
                     "another 10–15% latency reduction")),
    Given("lessonlib/claims/recorded.py", "-", "one launch against apply_rope + store_kv", "the two implementations timed"),
    Given("lessonlib/claims/recorded.py", "-", "silu(gate + b)·(up + b) in one kernel", "the implementation timed"),
    Given("lessonlib/claims/recorded.py", "-", "(holds: the fused call is the faster, by any margin)",
          "the verdict's rule, stated: the cuts beside it are computed"),
    Given("lessonlib/claims/recorded.py", "-", "(claimed: up to 70%", "the news item's claim, quoted for comparison"),
    Measured("lessonlib/claims/recorded.py", "-", "against eager's five kernels", "five kernels",
             lambda: _launches("eager: matmul, scale, mask, softmax, matmul")),
    Measured("lessonlib/plots/paged_attention.py", "-", "32 query heads over 8 KV heads", "over 8", _paged_kv_heads),
    Given("lessonlib/plots/paged_attention.py", "-", "whisker slowest to fastest", "what the whisker spans: a legend"),
    Given("lessonlib/plots/cuda_graphs.py", "-", "(lower is faster)", "how to read the axis"),
)
# lesson 00's roofline explorer and the traffic models it reads; lesson 03's RoPE exercise
LREST += (
    Given("lessonlib/widgets/__init__.py", "-", "fastest possible: eager",
          "the roofline's floor, t_floor = max(bytes / bandwidth, FLOPs / peak): a definition (lesson 00)"),
    Given("lessonlib/traffic.py", "-", "two launches", "the name of the two-kernel strategy the model counts"),
    Given("lessonlib/traffic.py", "-", "neg(second half of", "a kernel's name: rotate_half negates the second half"),
    Given("lessonlib/exercises/rope_store_kv.py", "-", "the first half of the output is x1 * cos - x2 * sin",
          "rotate_half's definition (Llama's convention)"),
)
# lessons 03 and 05's predict-then-measure bands (lessonlib/exercises/predictions.py)
LREST += (
    Given("lessonlib/exercises/predictions.py", "-", "each of the three passes over",
          "the model the exercise states: the gather reads the pages and writes a copy, SDPA reads the copy"),
    Measured("lessonlib/exercises/predictions.py", "-", "the 537 MB of K and V", "537 MB",
             lambda: _gather_case()["lessonlib"]["bytes"] / 1e6),
    Holds("lessonlib/exercises/predictions.py", "-", "is memory-bound at this size, over 100 µs against a few µs",
          lambda: min(r["us"] for k, r in _gather_case().items() if k != "bandwidth") > 100,
          "both recorded paths over 100 µs a call; a launch costs a few µs (lesson 05)"),
    Holds("lessonlib/exercises/predictions.py", "-", "both paths run at 85 to 90% of the copy bandwidth",
          lambda: all(0.845 <= f < 0.905 for f in _gather_fractions_of_copy()),
          "paged attention's GB/s and the gather path's three passes' GB/s over the recorded copy ceiling"),
    Given("lessonlib/exercises/predictions.py", "-", "the byte ratio to about ±15%", "the checker's band (0.15)"),
    Given("lessonlib/exercises/predictions.py", "-", "one launch's cost alone gives", "a mistake's name: one launch"),
    Measured("lessonlib/exercises/predictions.py", "-", "(add_rms_norm: 50 µs)", "50 µs",
             lambda: _per_call_us("lessonlib.ops.add_rms_norm")),
    Given("lessonlib/exercises/predictions.py", "-", "about ±30% either way", "the checker's band (0.30)"),
)
GENERATED = GENERATED + LREST
