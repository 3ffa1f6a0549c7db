"""Lesson 02's launch-bound attention: the news item's "by up to 70%", measured on the mechanism it names.

The claim: merging attention's softmax and matrix-product kernels into one cuts the launch overhead. At tiny
sequence lengths (B=1, H=8, T=16..1024, D=64, causal) the GPU work of attention is a few microseconds, so what an
eager model pays is its kernels' launches. Peers, each checked against float64 before anything is timed:

    eager attention   q @ kᵀ, * scale, masked_fill, softmax, @ v: five kernels, as a model written in PyTorch runs it
    lessonlib         ops.flash_attention: one launch
    SDPA              PyTorch's fused kernel (FlashAttention-2 where the GPU has it): one launch, or two where it
                      splits the keys among programs and combines their partial results in a second kernel
                      (split-KV; on the H200 at T = 512 and 1,024)

Each is timed per call, back to back (``measure.time_back_to_back``: what a decode loop pays, launches included),
and replayed from a CUDA graph (``graph_us``: the host's side of the launches gone, the GPU's work alone, each
kernel's own start-up included); each record also carries the kernels one call launches
(``measure.count_launches``). The claim's one definition: the time cut by fusion is
``1 - fused / eager``, per call back to back (:func:`time_cuts`); the claims table (``lessonlib.claims``) and
lesson 02 both read it from here.

    python -m benchmarks.bench_attention_launches --out lessonlib/results/attention-launches-h200.json
"""

from __future__ import annotations

import torch

from lessonlib import ops, reference, runtime, sdpa
from lessonlib.measure import count_launches, time_back_to_back
from lessonlib.results import SDPA_BACKEND_IMPLS, Impl, Op, Regime, Results
from lessonlib.testing import check_close, to_float64

HEADS, HEAD_DIM = 8, 64
LENGTHS = (16, 32, 64, 128, 256, 512, 1024)  # the short ones launch-bound; by 1024 the score matrix has weight
SMOKE = dict(heads=2, head_dim=64, lengths=(16, 40))  # D=64: the scale 1/8 is exact in 16 bits, as on the GPU
CALLS = 200  # calls per back-to-back span: a span of a few ms, long beside the events' resolution


def eager_attention(q, k, v, drop):
    """Attention as a model written in eager PyTorch runs it: five kernels, each reading and writing
    the (T, T) scores. ``drop``: (T, T) bool, True above the diagonal (made once, like a model's
    registered buffer)."""
    scores = q @ k.transpose(-1, -2)  # (B, H, T, T)   kernel 1: matmul
    scores = scores * q.shape[-1] ** -0.5  # kernel 2: scale
    scores = scores.masked_fill(drop, float("-inf"))  # kernel 3: mask
    p = torch.softmax(scores, dim=-1)  # kernel 4: softmax
    return p @ v  # (B, H, T, D)   kernel 5: matmul


def fused_sdpa_impl() -> tuple[str, tuple[str, ...] | None]:
    """SDPA's label and backends here: FlashAttention-2, else cuDNN, else the memory-efficient kernel (a T4 has
    only that); on CPU, SDPA as PyTorch chooses."""
    if not runtime.on_gpu():
        return Impl.SDPA, None
    backend = next(b for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
                   if b in sdpa.available_backends())
    return SDPA_BACKEND_IMPLS[backend], (backend,)


def peers(q, k, v) -> dict:
    """impl -> the call, its inputs bound."""
    drop = ~reference.causal_mask(q.shape[2], k.shape[2], q.device)
    sdpa_impl, backends = fused_sdpa_impl()
    return {Impl.EAGER_ATTENTION: lambda: eager_attention(q, k, v, drop),
            Impl.LESSONLIB: lambda: ops.flash_attention(q, k, v, causal=True),
            sdpa_impl: lambda: sdpa.scaled_dot_product_attention(q, k, v, True, backends=backends)}


def check(q, k, v, calls: dict) -> None:
    """The eager formula in float64 against the reference (it must be attention, mask and all), then every peer in
    the run's dtype against float64, allowed twice the error of the reference in that dtype (testing's rule)."""
    q64, k64, v64 = to_float64(q, k, v)
    eager64 = eager_attention(q64, k64, v64, ~reference.causal_mask(q.shape[2], k.shape[2], q64.device))
    truth, low = reference.attention(q64, k64, v64, causal=True), reference.attention(q, k, v, causal=True)
    check_close("eager attention (float64)", eager64, truth, truth)
    for impl, call in calls.items():
        check_close(impl, call(), truth, low)


def nbytes(q) -> int:
    """The fewest bytes attention must move: q, k, v read and the output written."""
    return 4 * q.numel() * q.element_size()


def measure(run, lengths=LENGTHS, heads=HEADS, head_dim=HEAD_DIM, calls=CALLS) -> None:
    """Every peer at each length: checked, its launches counted, timed back to back and from a graph."""
    for t in lengths:
        q, k, v = (torch.randn(1, heads, t, head_dim, device=runtime.device()).to(run.dtype) for _ in range(3))
        shape = {"B": 1, "H": heads, "T": t, "D": head_dim, "causal": True}
        timed = peers(q, k, v)
        check(q, k, v, timed)
        if run.check_only:
            print(f"checked {Op.LAUNCH_BOUND_ATTENTION} {shape}: {', '.join(timed)}", flush=True)
            continue
        for impl, call in timed.items():
            launches = count_launches(call)
            run.measure(Op.LAUNCH_BOUND_ATTENTION, impl, shape, call, nbytes(q),
                        timer=lambda fn: time_back_to_back(fn, calls), graph=True, regime=Regime.PER_CALL,
                        launches=launches.total, kernels=dict(launches.by_name))


def time_cuts(results: Results, fused: str = Impl.LESSONLIB, field: str = "us") -> dict[int, float]:
    """The time cut by fusion, ``1 - fused / eager``, at each recorded T: the claim's one definition. ``field``
    "graph_us" gives the same from the graph replays (the GPU's work alone, no launches)."""
    cuts = {}
    for eager in results.select(op=Op.LAUNCH_BOUND_ATTENTION, impl=Impl.EAGER_ATTENTION):
        one = results.select(op=Op.LAUNCH_BOUND_ATTENTION, impl=fused, **eager["shape"])
        if one and one[0].get(field) is not None and eager.get(field) is not None:
            cuts[eager["shape"]["T"]] = 1 - one[0][field] / eager[field]
    return cuts


def measure_live(lengths=LENGTHS) -> Results:
    """The benchmark's cases timed on this GPU now (a few seconds), as a Results the plot takes."""
    from lessonlib import bench
    from lessonlib.results import Benchmark, environment

    run = bench.Run(Benchmark.ATTENTION_LAUNCHES)
    measure(run, lengths)
    return Results(run.benchmark, "lessonlib.cases.attention_launches.measure_live()", environment(), {},
                   run.records, {})


def launch_counts(results: Results, impl: str) -> dict[int, int]:
    """The kernels one call of ``impl`` launched at each recorded T (torch.profiler's count, kept in each record)."""
    rows = sorted(results.select(op=Op.LAUNCH_BOUND_ATTENTION, impl=impl), key=lambda r: r["shape"]["T"])
    return {r["shape"]["T"]: r["launches"] for r in rows if r.get("launches") is not None}


def launches_text(counts: dict[int, int]) -> str:
    """"5 kernels" when every length launched as many; else each count with the lengths it held at, e.g.
    "1 kernel at T=16-256, 2 at T=512-1024" (SDPA's FlashAttention-2 splits the keys at longer T)."""
    runs: list[list] = []  # [count, first T, last T] for each stretch of lengths with one count
    for t, n in counts.items():
        if runs and runs[-1][0] == n:
            runs[-1][2] = t
        else:
            runs.append([n, t, t])
    if len(runs) == 1:
        return f"{runs[0][0]} kernel{'s' if runs[0][0] != 1 else ''}"
    parts = [f"{n} at T={a}" + (f"-{b}" if b != a else "") for n, a, b in runs]
    return parts[0].replace(" at", f" kernel{'s' if runs[0][0] != 1 else ''} at", 1) + ", " + ", ".join(parts[1:])


def table(results: Results) -> str:
    """Kernels per call and the time cut by fusion (back to back, and from a graph) per T, one column per T, in
    lines of at most 100 characters."""
    impls = list(dict.fromkeys(r["impl"] for r in results.select(op=Op.LAUNCH_BOUND_ATTENTION)))
    lengths = sorted({r["shape"]["T"] for r in results.select(op=Op.LAUNCH_BOUND_ATTENTION)})
    lines = [f"{'T':>30}" + "".join(f"{t:>7}" for t in lengths)]
    for impl in impls:
        counts = launch_counts(results, impl)
        name = "eager" if impl == Impl.EAGER_ATTENTION else impl
        lines.append(f"{name + ': kernels per call':30s}" + "".join(f"{counts.get(t, '-'):>7}" for t in lengths))
        if impl == Impl.EAGER_ATTENTION:
            continue
        for field, label in (("us", "time cut, back to back"), ("graph_us", "time cut, graph replay")):
            cut = time_cuts(results, impl, field)
            lines.append(f"  {label:28s}" + "".join(f"{cut[t]:>7.0%}" if t in cut else f"{'-':>7}" for t in lengths))
    return "\n".join(lines)
