"""The measurable claims of the course's two source texts, each beside the lesson cell that measures it and its
verdict (the closing section of lesson 05).

The two texts: the tutorial "Fast Attention Kernels & Operator Fusion", which the course is named after, and a news
item on kernel fusion (it says that fusing the softmax and matmul kernels cuts launch overhead "by up to 70%", and that
CUDA graphs "deliver another 10–15% latency reduction"). Neither text is in the repository. A claim with
``quoted=True`` is worded exactly as the course's notebooks quote it; the others are paraphrased, and the table says
so. The two figures are the news item's; the other claims are the tutorial's. Each verdict is computed when
asked, from a committed results file (``lessonlib/results/*.json``, :mod:`lessonlib.claims.recorded`) or from a
live check on this machine (:mod:`lessonlib.claims.live`): no verdict and no measured number is typed in. A claim
whose records are not committed yet says "not yet measured on a GPU" and names the command that records them.
Verdicts read "holds", "holds at ...; not at ...", "does not hold (...)" or "not measured here (why)".

    rows = claims.table()          # one dict per claim: quote, source, where, measured, verdict
    display(Markdown(claims.markdown(rows)))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lessonlib.claims import live, recorded
from lessonlib.claims.verdicts import Verdict, in_range, not_recorded

NEWS = "news item"
TUTORIAL = "tutorial"  # "Fast Attention Kernels & Operator Fusion", the course's namesake

# The news item's "up to 70%", defined once: the table below and lesson 05's text both use these words.
LAUNCH_CUT = ("fusing attention's kernels (matmul, scale, mask, softmax, matmul) into one launch cuts the time "
              "spent on kernel launches")


@dataclass(frozen=True)
class Claim:
    quote: str  # quoted: the source's words as the notebooks quote them; otherwise a paraphrase
    quoted: bool
    source: str  # NEWS or TUTORIAL
    notebook: str  # notebooks/<notebook>.ipynb
    cell: str  # the id of the cell that measures it (tests check that it exists)
    section: str
    evidence: str  # the records, or the live check, that decide it
    decide: Callable[[], Verdict]


def not_measured(why: str) -> Callable[[], Verdict]:
    return lambda: Verdict("-", f"not measured here ({why})")


CLAIMS = (
    Claim("cut by up to 70%", True, NEWS, "02_flash_attention", "launch-bound-run",
          "§6 Launch-bound attention: the news item's 70%",
          f"attention-launches-h200: {LAUNCH_CUT}; eager attention's five kernels against one fused launch, at "
          "launch-bound sizes",
          recorded.launch_cut),
    Claim("deliver another 10–15% latency reduction", True, NEWS, "05_cuda_graphs", "36d3873b",
          "§5 Measured on the H200", "cuda-graphs-h200: decode_step, fused step vs the same replayed from a graph",
          recorded.graph_cut),
    Claim("softmax(Q Kᵀ / √D + M) V, with M the additive causal mask", True, TUTORIAL, "02_flash_attention",
          "acf5f14c", "§1 The score matrix", "live: float64, M = -inf above the diagonal vs causal=True",
          live.additive_mask),
    Claim("FlashAttention's memory is O(N) instead of O(N²)", False, TUTORIAL, "02_flash_attention", "66d71694",
          "§1 The score matrix grows with T²", "live: bytes each call allocates, N=32 and 64", live.linear_memory),
    Claim("fusing the KV-cache write with the K/V transform", True, TUTORIAL, "03_paged_attention", "d16831f5",
          "Exercise 5: RoPE fused with the KV-cache write",
          "paged-attention-h200: rope_store_kv, ops.rope_store_kv vs apply_rope + store_kv", recorded.rope_kv_write),
    Claim("sidesteps the quadratic memory blow-up", True, TUTORIAL, "03_paged_attention", "7304ab0d",
          "§6 What paging does not change", "live: kv_memory's paged and slab reservations, the score matrix's bytes",
          live.paging_quadratic),
    Claim("paged attention removes the KV-cache waste of fragmentation and over-reservation", False, TUTORIAL,
          "03_paged_attention", "ca032502", "§1 What contiguous allocation wastes",
          "live: kv_memory.reservation over lesson 03's request lengths", live.paging_waste),
    Claim("FlexAttention runs paged attention", False, TUTORIAL, "03_paged_attention", "e0128fdf",
          "§7 Paged against contiguous, measured", "paged-attention-h200: FlexAttention paged vs lessonlib",
          recorded.flex_paged),
    Claim("fusion changes the numbers: the order of operations rounds differently", False, TUTORIAL,
          "04_torch_compile", "48f16569", "§1 What Inductor generates", "live: float16 swiglu, eager vs fused",
          live.op_order),
    Claim("TORCH_LOGS=perf_hints,output_code show what Inductor did and could not do", False, TUTORIAL,
          "04_torch_compile", "95a3c005", "§4 Inductor's hints, and the code it wrote", "lesson 04's cell, live",
          not_measured("lesson 04 runs it in a fresh compiling process, too slow to repeat for this table")),
    Claim("fuse bias + activation + multiply", False, TUTORIAL, "01_operator_fusion", "bias-swiglu-run",
          "§12 Bias + activation + multiply: bias_swiglu",
          "fusion-extras-h200: bias_swiglu, lessonlib vs eager and torch.compile, T=8192", recorded.bias_activation_mul),
    Claim("fuse dequantisation into the matmul", False, TUTORIAL, "01_operator_fusion", "dequant-matmul-run",
          "§13 Dequantisation inside the matmul: dequant_matmul",
          "fusion-extras-h200: dequant_matmul, lessonlib vs eager dequantise-then-GEMM, M=1, 16, 2048",
          recorded.dequant_matmul),
    Claim("fusing dropout/scaling/residual into attention: the scaling", False, TUTORIAL, "05_cuda_graphs",
          "c1a1ab03", "§6 What attention's kernel can absorb",
          "flash-attention-h200: absorbed into attention, lessonlib vs Q scaled in a pass of its own",
          recorded.softmax_scale),
    Claim("fusing dropout/scaling/residual into attention: the dropout", False, TUTORIAL, "05_cuda_graphs",
          "c1a1ab03", "§6 What attention's kernel can absorb",
          "flash-attention-h200: absorbed into attention, SDPA backends at dropout_p 0 and 0.1", recorded.dropout),
    Claim("fusing dropout/scaling/residual into attention: the residual", False, TUTORIAL, "01_operator_fusion",
          "a8fdf751", "§6 Residual add + RMSNorm; Summary", "fusion-h200: add_rms_norm, lessonlib vs eager, T=8192",
          recorded.residual),
)


def table(claims=CLAIMS) -> list[dict]:
    """Every claim's row, its verdict computed now."""
    rows = []
    for claim in claims:
        verdict = claim.decide()
        quote = f"“{claim.quote}”" if claim.quoted else f"{claim.quote} (paraphrased)"
        rows.append({"quote": quote, "source": claim.source,
                     "where": f"lesson {claim.notebook[:2]}, {claim.section} (cell {claim.cell})",
                     "evidence": claim.evidence, "measured": verdict.measured, "verdict": verdict.verdict})
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table: claim, source text, where measured, measured value, verdict."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| claim | source | where measured | measured | verdict |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell(r[key]) for key in ("quote", "source", "where", "measured", "verdict")) + " |"
              for r in rows]
    return "\n".join(lines)


__all__ = ["CLAIMS", "LAUNCH_CUT", "NEWS", "TUTORIAL", "Claim", "Verdict", "in_range", "live", "markdown",
           "not_measured", "not_recorded", "recorded", "table"]
