"""The figures in what lessonlib shows a student (legends, titles, tables, checker messages, hints, printed
verdicts), each with what makes it true: the same kinds as the notebooks' markdown (tests/prose_figures.py), with
the module's path in place of the notebook and no cell. A figure that code formats from the data needs no entry."""

from __future__ import annotations

from tests.prose_figures import Given, Holds, Measured  # noqa: F401  (the kinds entries use)


def _launches(impl: str) -> int:
    """Kernels per call of ``impl`` in the recorded launch-bound attention run, one count for every shape."""
    from lessonlib import results

    counts = {r["launches"] for r in results.load("attention-launches-h200").select(impl=impl)}
    return counts.pop() if len(counts) == 1 else -1


def _paged_kv_heads() -> float:
    from lessonlib import results

    heads = {r["shape"]["Hkv"] for r in results.load("paged-attention-h200").select(op="paged_attention")}
    return heads.pop() if len(heads) == 1 else -1

GENERATED = ()

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
GENERATED = GENERATED + LREST
