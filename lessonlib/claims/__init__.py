"""The measurable claims of the course's two source texts, each beside the lesson cell that measures it and its
verdict (the closing section of lesson 05).

The two texts (:mod:`lessonlib.claims.quotations`: titles, publisher, date, and every phrase the course quotes): the
tutorial "Fast Attention Kernels and Operator Fusion", which the course is named after, and the news item of the same
title (Tefisc Fact Engine, November 12, 2026). Each claim is a short phrase of one text, verbatim and registered in
``quotations.QUOTATIONS`` with that text as its source, and the course's reading of it in its own words: what the cell
measures. Each verdict is computed when asked, from a recorded results file (``lessonlib/results/*.json``,
:mod:`lessonlib.claims.recorded`) or from a live check on this machine (:mod:`lessonlib.claims.live`): no verdict and
no measured number is typed in. A claim whose records are missing says "not yet measured on a GPU" and names the
command that records them. Verdicts read "holds", "holds at ...; not at ...", "does not hold (...)" or "not measured
here (why)".

    rows = claims.table()          # one dict per claim: quote, claim, source, where, measured, verdict
    display(Markdown(claims.markdown(rows)))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lessonlib.claims import live, quotations, recorded
from lessonlib.claims.verdicts import Verdict, in_range, not_recorded

NEWS = quotations.NEWS.key  # "news item"
TUTORIAL = quotations.TUTORIAL.key  # "tutorial": the course's namesake

# The news item's "up to 70%", read once: the table below and lesson 05's text both use these words.
LAUNCH_CUT = ("fusing attention's kernels (matmul, scale, mask, softmax, matmul) into one launch cuts the time "
              "spent on kernel launches")


@dataclass(frozen=True)
class Claim:
    quote: str  # the source's own words, verbatim and registered in quotations.QUOTATIONS with ``source``
    reading: str  # what the course measures, in its own words
    source: str  # NEWS or TUTORIAL
    notebook: str  # notebooks/<notebook>.ipynb
    cell: str  # the id of the cell that measures it (tests check that it exists)
    section: str
    evidence: str  # the records, or the live check, that decide it
    decide: Callable[[], Verdict]


def not_measured(why: str) -> Callable[[], Verdict]:
    return lambda: Verdict("-", f"not measured here ({why})")


_ABSORBED = "combining dropout, scaling, and residual addition directly into the attention kernel"

CLAIMS = (
    Claim("cutting kernel launch overhead by up to 70%", LAUNCH_CUT + ", by up to 70%", NEWS, "02_flash_attention",
          "launch-bound-run", "§6 Launch-bound attention",
          "attention-launches-h200: eager attention's five kernels against one fused launch, at launch-bound sizes",
          recorded.launch_cut),
    Claim("delivering another 10–15% latency reduction",
          "replaying the fused decode step from a CUDA graph cuts its time by another 10–15%", NEWS, "05_cuda_graphs",
          "36d3873b", "§5 Measured on the H200", "cuda-graphs-h200: decode_step, fused step vs the same replayed from "
          "a graph", recorded.graph_cut),
    Claim("Ordinary attention with an additive attention mask",
          "softmax(Q Kᵀ / √D + M) V with M the additive causal mask (0 or -inf) is causal attention", TUTORIAL,
          "02_flash_attention", "acf5f14c", "§1 The score matrix", "live: float64, M = -inf above the diagonal vs "
          "causal=True", live.additive_mask),
    Claim("It avoids storing the complete score matrix in global memory",
          "FlashAttention's memory grows as O(N), not O(N²)", TUTORIAL, "02_flash_attention", "66d71694",
          "§1 The score matrix grows with T²", "live: bytes each call allocates, N=32 and 64", live.linear_memory),
    Claim("Updating the KV cache while transforming key and value tensors",
          "RoPE and the KV-cache write in one launch are faster than apply_rope then store_kv", TUTORIAL,
          "03_paged_attention", "d16831f5", "Exercise 5: RoPE fused with the KV-cache write",
          "paged-attention-h200: rope_store_kv, ops.rope_store_kv vs apply_rope + store_kv", recorded.rope_kv_write),
    Claim("sidesteps the quadratic memory blow-up", "paging the KV cache avoids memory that grows as N²", NEWS,
          "03_paged_attention", "7304ab0d", "§6 What paging does not change",
          "live: kv_memory's paged and slab reservations, the score matrix's bytes", live.paging_quadratic),
    Claim("It reduces fragmentation and reserved capacity",
          "a paged KV cache leaves less memory held but unused than a slab per request", TUTORIAL,
          "03_paged_attention", "ca032502", "§1 What contiguous allocation wastes",
          "live: kv_memory.reservation over lesson 03's request lengths", live.paging_waste),
    Claim("PyTorch can implement paged attention with FlexAttention and torch.compile()",
          "FlexAttention runs paged attention at the recorded shapes", TUTORIAL, "03_paged_attention", "e0128fdf",
          "§7 Paged against contiguous, measured", "paged-attention-h200: FlexAttention paged vs lessonlib",
          recorded.flex_paged),
    Claim("compilation can change the order of floating-point operations",
          "fused code rounds at other steps, so its results differ from eager's", TUTORIAL, "04_torch_compile",
          "48f16569", "§1 What Inductor generates", "live: float16 swiglu, eager vs fused", live.op_order),
    Claim("PyTorch will log hints about CUDA Graph eligibility and other compiler choices",
          "TORCH_LOGS=perf_hints and output_code show what Inductor could not do and the code it wrote", TUTORIAL,
          "04_torch_compile", "95a3c005", "§4 Inductor's hints, and the code it wrote", "lesson 04's cell, live",
          not_measured("lesson 04 runs it in a fresh compiling process, too slow to repeat for this table")),
    Claim("Applying bias, activation, and element-wise multiplication",
          "bias + activation + multiply in one kernel is faster than eager", TUTORIAL, "01_operator_fusion",
          "bias-swiglu-run", "§12 Bias + activation + multiply: bias_swiglu",
          "fusion-extras-h200: bias_swiglu, lessonlib vs eager and torch.compile, T=8192", recorded.bias_activation_mul),
    Claim("Combining dequantization with matrix multiplication",
          "an int8 weight dequantised inside the matmul is faster than F.linear on the 16-bit weight", TUTORIAL,
          "01_operator_fusion", "dequant-matmul-run", "§13 Dequantisation inside the matmul: dequant_matmul",
          "fusion-extras-h200: dequant_matmul, lessonlib vs F.linear on the 16-bit weight (and eager "
          "dequantise-then-GEMM), M=1, 16, 2048", recorded.dequant_matmul),
    Claim(_ABSORBED, "the softmax scale fused into attention's kernel", NEWS, "05_cuda_graphs", "c1a1ab03",
          "§6 What attention's kernel can absorb",
          "flash-attention-h200: absorbed into attention, lessonlib vs Q scaled in a pass of its own",
          recorded.softmax_scale),
    Claim(_ABSORBED, "dropout fused into attention's kernel", NEWS, "05_cuda_graphs", "c1a1ab03",
          "§6 What attention's kernel can absorb",
          "flash-attention-h200: absorbed into attention, SDPA backends at dropout_p 0 and 0.1", recorded.dropout),
    Claim(_ABSORBED, "the residual add fused into attention's kernel", NEWS, "01_operator_fusion", "a8fdf751",
          "§6 Residual add + RMSNorm; Summary", "fusion-h200: add_rms_norm, lessonlib vs eager, T=8192",
          recorded.residual),
)


def table(claims=CLAIMS) -> list[dict]:
    """Every claim's row, its verdict computed now."""
    rows = []
    for claim in claims:
        verdict = claim.decide()
        rows.append({"quote": f"\u201c{claim.quote}\u201d", "claim": claim.reading, "source": f"the {claim.source}",
                     "where": f"lesson {claim.notebook[:2]}, {claim.section} (cell {claim.cell})",
                     "evidence": claim.evidence, "measured": verdict.measured, "verdict": verdict.verdict})
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table: the source's words and the course's reading of them, the source text, where
    measured, measured value, verdict. The sources' titles, publisher and date follow the table."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| the text's words | read here as | source | where measured | measured | verdict |",
             "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell(r[key]) for key in ("quote", "claim", "source", "where", "measured", "verdict"))
              + " |" for r in rows]
    cited = [f"the {s.key}: {s.citation()}" for s in quotations.SOURCES.values()]
    return "\n".join(lines) + "\n\nSources: " + "; ".join(cited) + "."


__all__ = ["CLAIMS", "LAUNCH_CUT", "NEWS", "TUTORIAL", "Claim", "Verdict", "in_range", "live", "markdown",
           "not_measured", "not_recorded", "quotations", "recorded", "table"]
