"""The figures in what lessonlib shows a student (legends, titles, tables, checker messages, hints, printed
verdicts), each with what makes it true: the same kinds as the notebooks' markdown (tests/prose_figures.py), with
the module's path in place of the notebook and no cell. A figure that code formats from the data needs no entry."""

from __future__ import annotations

import itertools

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


def _swiglu_chains() -> list[tuple]:
    """(the chain's traffic model, its recorded µs, the copy of the same bytes' GB/s) for eager and the fused kernel,
    at the shape of lesson 01's predict-then-measure case."""
    from lessonlib.exercises import predictions

    r = predictions.SWIGLU.recorded()
    model = traffic.swiglu(r["tokens"], r["intermediate"], r["itemsize"])
    return [(model.eager, r["eager_us"], r["copy_gbps"]), (model.fused, r["fused_us"], r["copy_gbps"])]


def _swiglu_worst_model_error(rate_off: float = 0.05) -> float:
    """The largest |measured / predicted - 1| of the swiglu item when the fused and the eager chain each run up to
    ``rate_off`` away from the copy rate, either way (the model adds s's two trips at exactly the copy rate; the
    error is monotonic in each rate, so the corners bound it)."""
    from lessonlib.exercises import predictions

    r = predictions.SWIGLU.recorded()
    model = traffic.swiglu(r["tokens"], r["intermediate"], r["itemsize"])
    worst = 0.0
    for fused_off, eager_off in itertools.product((-rate_off, rate_off), repeat=2):
        fused_us = model.fused.bytes / (r["copy_gbps"] * (1 + fused_off) * 1e3)
        eager_us = model.eager.bytes / (r["copy_gbps"] * (1 + eager_off) * 1e3)
        predicted = predictions.SWIGLU.predict(**dict(r, fused_us=fused_us, eager_us=eager_us))
        worst = max(worst, abs(eager_us / fused_us / predicted - 1))
    return worst


def _same_forward_timings() -> list[float]:
    """The µs of lesson 02's forward kernel (its default D=128 tiles, B=2, N=4096, not causal) wherever the
    flash-attention run timed it: the plain forward, the variant check, the sweep's default point, the absorbed
    scaling."""
    from lessonlib import results

    flash = results.load("flash-attention-h200")
    default = results.sweep_label(flash.notes["default_configs"]["D=128"]["forward"])
    return [r["us"] for r in flash.records if r["shape"].get("N") == 4096 and r["shape"].get("B") == 2
            and r["shape"].get("D") == 128 and not r["shape"].get("causal") and not r["shape"].get("dropout_p")
            and r["impl"] in (Impl.LESSONLIB, default)
            and r["op"] in (Op.FORWARD, Op.FORWARD_VARIANT, Op.ABSORBED)]


def _causal_forward_tflops() -> list[float]:
    """TFLOP/s of the full and the causal forward the causal_speedup item compares (B=2, H=32, N=8192, D=128)."""
    from lessonlib import results

    flash = results.load("flash-attention-h200")
    return [flash.one(op=Op.FORWARD, impl=Impl.LESSONLIB, B=2, H=32, N=8192, D=128, causal=c)["tflops"]
            for c in (False, True)]


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
    Holds("lessonlib/exercises/predictions.py", "-", "at T=8192 each chain moves over 200 MB, within 5% of the copy rate",
          lambda: all(k.bytes > 200e6 for chain, _, _ in _swiglu_chains() for k in chain.kernels)
          and all(abs(chain.bytes / (us * 1e3) / copy - 1) <= 0.05 for chain, us, copy in _swiglu_chains()),
          "every kernel of eager's chain and the fused one over 200 MB; each chain's own bytes over its recorded time "
          "within 5% of the copy of the same bytes"),
    Holds("lessonlib/exercises/predictions.py", "-", "5% either way moves eager's time over the fused time by at most "
          "9% from the model", lambda: _swiglu_worst_model_error(0.05) <= 0.09,
          "the item's model evaluated with each chain's rate 5% off the copy rate, either way: the worst error"),
    Given("lessonlib/exercises/predictions.py", "-", "1 GB/s moves 1e3 bytes per µs",
          "a unit conversion: 1 GB/s is 1e9 bytes per second, 1e3 bytes per µs"),
    Given("lessonlib/exercises/predictions.py", "-", "half the work, ignoring the diagonal tiles, gives:",
          "a mistake's name: the causal pass taken as half the full pass's tiles, the ratio 2 that the mistake computes"),
    Holds("lessonlib/exercises/predictions.py", "-", "at N = 8192 the kernel is compute-bound (over 400 TFLOP/s)",
          lambda: min(_causal_forward_tflops()) > 400, "the full and the causal forward's recorded TFLOP/s at N=8192"),
    Measured("lessonlib/exercises/predictions.py", "-", "the same kernel timed several times in this run",
             "several times", lambda: len(_same_forward_timings())),
    Measured("lessonlib/exercises/predictions.py", "-", "spreads over about 5%", "about 5",
             lambda: 100 * (max(_same_forward_timings()) / min(_same_forward_timings()) - 1)),
)
GENERATED = GENERATED + LREST
