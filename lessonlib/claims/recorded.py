"""Claims decided by the committed GPU runs (``lessonlib/results/*.json``); without their records, a verdict says
"not yet measured on a GPU" and names the command that records them."""

from __future__ import annotations

import torch

from lessonlib import traffic
from lessonlib.claims.live import dropout_on_cpu
from lessonlib.claims.verdicts import Verdict, committed_run, in_range, not_recorded, pct
from lessonlib.results import Benchmark, Impl, Op


def _decode_step_cuts() -> dict[str, tuple[float, float]] | None:
    """(fusion's cut of the plain step, the graph's cut of the fused step) per (B, context) recorded."""
    run = committed_run(Benchmark.CUDA_GRAPHS)
    if run is None or not run.select(op=Op.DECODE_STEP):
        return None
    cuts = {}
    for plain in run.select(op=Op.DECODE_STEP, impl=Impl.EAGER_STEP):
        shape = {k: plain["shape"][k] for k in ("B", "context")}
        fused = run.one(op=Op.DECODE_STEP, impl=Impl.FUSED_STEP, **shape)["us"]
        graph = run.one(op=Op.DECODE_STEP, impl=Impl.FUSED_STEP_GRAPH, **shape)["us"]
        cuts[f"B={shape['B']}/ctx {shape['context']:,}"] = (1 - fused / plain["us"], 1 - graph / fused)
    return cuts


def _cut_verdict(which: int, what: str, low: float, high: float, claimed: str) -> Verdict:
    """The verdict on one of the two cuts (0: fusion's, 1: the graph's) against a claimed range [low, high]."""
    cuts = _decode_step_cuts()
    if cuts is None:
        return not_recorded(Benchmark.CUDA_GRAPHS, "decode_step records")
    points = {p: cut[which] for p, cut in cuts.items()}
    measured = what + " " + ", ".join(f"{pct(x)} ({p})" for p, x in points.items())
    return Verdict(measured, in_range(points, low, high) + f" (claimed: {claimed})")


def graph_cut() -> Verdict:
    return _cut_verdict(1, "the graph cut the fused step by another", 0.10, 0.15, "10-15%")


def flex_paged() -> Verdict:
    run = committed_run(Benchmark.PAGED_ATTENTION)
    flex = [] if run is None else run.select(op=Op.PAGED_ATTENTION, impl=Impl.FLEX_PAGED)
    if not flex:
        return not_recorded(Benchmark.PAGED_ATTENTION, "FlexAttention paged records")
    ran, refused, times = [], [], []
    for rec in flex:
        point = f"B={rec['shape']['B']}/ctx {rec['shape']['context']:,}"
        if rec["us"] is None:
            refused.append(point)
            continue
        ran.append(point)
        ours = run.one(op=Op.PAGED_ATTENTION, impl=Impl.LESSONLIB, **rec["shape"])["us"]
        times.append(f"{rec['us']:.0f} µs vs lessonlib {ours:.0f} µs ({point})")
    error = next((r["error"] for r in flex if r["us"] is None), "")
    reason = error.split(": ")[-1].split(". ")[0]  # the innermost error's first sentence
    measured = "; ".join(times) + (f"; refused at {', '.join(refused)}: {reason}" if refused else "")
    return Verdict(measured, f"holds at {', '.join(ran)}" + (f"; not at {', '.join(refused)}" if refused else "")
                   if ran else "does not hold at any recorded shape")


# --- lesson 01: what fusion covers (fusion-h200) ------------------------------------------------------------------


def _fused_vs_eager(op: str, shape: dict) -> float | None:
    """How many times faster lessonlib's fused kernel ran than eager PyTorch at ``shape`` (the bandwidth regime)."""
    run = committed_run(Benchmark.FUSION)
    if run is None:
        return None
    rec = {r["impl"]: r["us"] for r in run.select(op=op, **shape) if "regime" not in r}
    return rec[Impl.EAGER] / rec[Impl.LESSONLIB] if Impl.EAGER in rec and Impl.LESSONLIB in rec else None


def activation_mul() -> Verdict:
    speedup = _fused_vs_eager(Op.SWIGLU, {"T": 8192, "I": 14336})
    if speedup is None:
        return not_recorded(Benchmark.FUSION, "swiglu records at T=8192")
    return Verdict(f"silu(gate)·up fused: {speedup:.1f}x eager (T=8192, I=14336)",
                   "holds for activation·mul; not measured here with a bias (the course's models have none)")


def _extras(op: str) -> list[dict]:
    run = committed_run(Benchmark.FUSION_EXTRAS)
    return [] if run is None else run.select(op=op)


def bias_activation_mul() -> Verdict:
    """bias_swiglu's records (fusion-extras-h200); until they are committed, swiglu's (no bias) beside the notice."""
    records = {r["impl"]: r for r in _extras(Op.BIAS_SWIGLU)}
    if Impl.LESSONLIB not in records or Impl.EAGER not in records:
        waiting = not_recorded(Benchmark.FUSION_EXTRAS, "bias_swiglu records")
        without = activation_mul()
        known = "" if without.verdict.startswith("not yet") else f"; without a bias: {without.measured}"
        return Verdict(waiting.measured + known, waiting.verdict)
    ours, shape = records[Impl.LESSONLIB]["us"], records[Impl.LESSONLIB]["shape"]
    where = f"T={shape['T']}, I={shape['I']}"
    compiled = records.get(Impl.COMPILE, {}).get("us")
    versus = f", {compiled / ours:.2f}x torch.compile" if compiled else ""
    speedup = records[Impl.EAGER]["us"] / ours
    return Verdict(f"silu(gate + b)·(up + b) in one kernel: {speedup:.1f}x eager{versus} ({where})",
                   "holds" if speedup > 1 else f"does not hold at {where}")


def dequant_matmul() -> Verdict:
    """dequant_matmul (int8 weight, dequantised in registers) against the GEMM a practitioner would otherwise run,
    F.linear on the 16-bit weight, at each recorded M (fusion-extras-h200); eager dequantise-then-GEMM beside it. The
    claim holds at an M where the int8 kernel is strictly faster than that GEMM."""
    records = _extras(Op.DEQUANT_MATMUL)
    ours = [r for r in records if r["impl"] == Impl.LESSONLIB and r["us"] is not None]
    if not ours or not any(r["impl"] == Impl.LINEAR_16BIT and r["us"] is not None for r in records):
        return not_recorded(Benchmark.FUSION_EXTRAS, "dequant_matmul records beside F.linear on the 16-bit weight")
    parts, won, lost = [], [], []
    for rec in ours:
        peers = {r["impl"]: r["us"] for r in records if r["shape"] == rec["shape"]}
        point, linear, eager = f"M={rec['shape']['M']}", peers.get(Impl.LINEAR_16BIT), peers.get(Impl.EAGER)
        if linear is None:
            continue
        (won if rec["us"] < linear else lost).append(point)
        versus = "faster" if rec["us"] < linear else "slower"
        ratio = linear / rec["us"] if rec["us"] < linear else rec["us"] / linear
        parts.append(f"{point}: {rec['us']:.1f} µs, F.linear {linear:.1f} µs ({ratio:.2f}x {versus})"
                     + (f", eager dequantise-then-GEMM {eager:.1f} µs" if eager else ""))
    shape = ours[0]["shape"]
    measured = f"int8 weight ({shape['N']}x{shape['K']}) dequantised in registers: " + "; ".join(parts)
    if not lost:
        verdict = "holds at every measured M"
    elif not won:
        verdict = "does not hold at any measured M"
    else:
        verdict = f"holds at {', '.join(won)}; not at {', '.join(lost)}"
    return Verdict(measured, verdict + " (the int8 kernel against F.linear on the 16-bit weight)")


def residual() -> Verdict:
    speedup = _fused_vs_eager(Op.ADD_RMS_NORM, {"T": 8192, "H": 4096})
    if speedup is None:
        return not_recorded(Benchmark.FUSION, "add_rms_norm records at T=8192")
    return Verdict(f"the residual add fused into add_rms_norm instead: {speedup:.1f}x eager (T=8192, H=4096)",
                   "does not hold for attention: the output projection sits between attention and the residual "
                   "add, so the add fuses into the next RMSNorm (lesson 01), not into attention")


# --- what attention's kernel absorbs: scale and dropout (flash-attention-h200, Op.ABSORBED) ------------------------


def _absorbed() -> list[dict]:
    run = committed_run(Benchmark.FLASH_ATTENTION)
    return [] if run is None else run.select(op=Op.ABSORBED)


def _point(shape: dict) -> str:
    return f"N={shape['N']:,}{' causal' if shape['causal'] else ''}"


def softmax_scale() -> Verdict:
    records = _absorbed()
    folded = [r for r in records if r["impl"] == Impl.LESSONLIB and r["us"] is not None]
    if not folded:
        return not_recorded(Benchmark.FLASH_ATTENTION, "'absorbed into attention' records")
    parts, slower = [], []
    for rec in folded:
        shape = rec["shape"]
        separate = next(r for r in records if r["impl"] == Impl.PRESCALED_Q and r["shape"] == shape)["us"]
        itemsize = torch.empty((), dtype=getattr(torch, rec["dtype"])).element_size()
        extra = traffic.prescale_q_bytes(shape["N"], shape["H"], shape["D"], itemsize, shape["B"])
        parts.append(f"{_point(shape)}: folded {rec['us']:.0f} µs, a pass of its own {separate:.0f} µs "
                     f"({separate / rec['us'] - 1:+.0%}; +{extra / 1e6:.0f} MB moved)")
        slower.append(separate > rec["us"])
    timing = "and time" if all(slower) else "(time: no gain measured at " + ", ".join(
        _point(r["shape"]) for r, s in zip(folded, slower) if not s) + ")"
    return Verdict("; ".join(parts), f"holds: the scale rides in the kernel's exp2 for free, saving bytes {timing}")


def dropout() -> Verdict:
    sdpa_records = [r for r in _absorbed() if r["impl"] != Impl.LESSONLIB and r["impl"] != Impl.PRESCALED_Q]
    with_dropout = [r for r in sdpa_records if r["shape"]["dropout_p"] > 0]
    if not with_dropout:
        verdict = not_recorded(Benchmark.FLASH_ATTENTION, "'absorbed into attention' records")
        return Verdict("; ".join(filter(None, [verdict.measured, dropout_on_cpu()])), verdict.verdict)
    parts, ran, refused = [], [], []
    for rec in with_dropout:
        label = f"{rec['impl']} {_point(rec['shape'])}"
        without = next(r for r in sdpa_records if r["impl"] == rec["impl"] and r["shape"] == {
            **rec["shape"], "dropout_p": 0.0})["us"]
        if rec["us"] is None or without is None:
            refused.append(label)
            continue
        ran.append(rec["impl"])
        parts.append(f"{label}: {rec['us'] / without - 1:+.0%} with dropout_p={rec['shape']['dropout_p']}")
    measured = "; ".join(parts + ([f"refused: {', '.join(refused)}"] if refused else []) + [dropout_on_cpu()])
    inside = sorted({i for i in ran if i in (Impl.SDPA_FLASH, Impl.SDPA_EFFICIENT)})
    verdict = (f"holds at {', '.join(inside)} (mask drawn in the kernel from a seed)" if inside else
               "does not hold at any recorded backend")
    return Verdict(measured, verdict + "; not at lessonlib's kernel (no dropout: an inference kernel)"
                   + ("; SDPA math writes the mask out" if Impl.SDPA_MATH in ran else ""))


# --- lesson 03: RoPE fused with the KV-cache write (paged-attention-h200, Op.ROPE_STORE_KV) --------------------------


def rope_kv_write() -> Verdict:
    """ops.rope_store_kv against apply_rope then store_kv, per call; until a recorded run holds them, the verdict
    says so."""
    op, separate = Op.ROPE_STORE_KV, Impl.APPLY_ROPE_THEN_STORE_KV
    run = committed_run(Benchmark.PAGED_ATTENTION)
    fused = [] if run is None else [r for r in run.select(op=op, impl=Impl.LESSONLIB) if r["us"] is not None]
    if not fused:
        return not_recorded(Benchmark.PAGED_ATTENTION, "rope_store_kv records")
    cuts = {}
    for rec in fused:
        two = run.select(op=op, impl=separate, **rec["shape"])
        if two and two[0]["us"] is not None:
            cuts[f"T={rec['shape']['T']:,}/D={rec['shape']['D']}"] = 1 - rec["us"] / two[0]["us"]
    measured = "one launch against apply_rope + store_kv, per call: " + ", ".join(
        f"{-cut:+.0%} ({point})" for point, cut in cuts.items())
    return Verdict(measured, in_range(cuts, 1e-9, 1.0) + " (holds: the fused call is the faster, by any margin)")


# --- the news item's "up to 70%", on its mechanism: attention's kernels merged (attention-launches-h200) ----------


def launch_cut() -> Verdict:
    """The news item's "up to 70%" (claims.LAUNCH_CUT): the time cut by fusion at launch-bound sizes, ``1 - fused / eager`` per call back to back
    (:func:`lessonlib.cases.attention_launches.time_cuts`, the claim's one definition), for lessonlib's kernel and
    SDPA's. "Up to 70%" names a best case: it holds when the largest cut measured, rounded to a percent as the
    claim is, reaches 70%."""
    from lessonlib.cases.attention_launches import time_cuts

    run = committed_run(Benchmark.ATTENTION_LAUNCHES)
    if run is None or not run.select(op=Op.LAUNCH_BOUND_ATTENTION, impl=Impl.EAGER_ATTENTION):
        return not_recorded(Benchmark.ATTENTION_LAUNCHES, "launch-bound attention records")
    fused = [i for i in (Impl.LESSONLIB, Impl.SDPA_FLASH, Impl.SDPA_CUDNN, Impl.SDPA_EFFICIENT, Impl.SDPA)
             if run.select(op=Op.LAUNCH_BOUND_ATTENTION, impl=i)]
    parts, best = [], {}
    for impl in fused:
        cuts = time_cuts(run, impl)
        best[impl] = max(cuts.values())
        parts.append(f"{impl} against eager's five kernels: " + ", ".join(f"{pct(c)} (T={t})" for t, c in cuts.items()))
    top = max(best, key=best.get)
    reached = round(100 * best[top]) >= 70
    verdict = (f"holds: {top} cuts up to {pct(best[top])}" if reached else
               f"does not hold: the largest cut measured is {pct(best[top])} ({top})")
    return Verdict("; ".join(parts), verdict + " (claimed: up to 70%; cut = 1 - fused / eager, per call back to back)")
