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
