"""The recorded GPU run beside the student's own: lesson 01's fused ops (swiglu, add_rms_norm, apply_rope), at a
shape the recorded run holds, timed here for eager PyTorch, torch.compile and lessonlib. As in the benchmarks,
lessonlib's output is checked against float64 before anything is timed. Also lesson 01's table of int8 weights
(``dequant_matmul``) against F.linear on the 16-bit weight, from the recorded run."""

from __future__ import annotations

import torch

from lessonlib import ops, reference, runtime, traffic
from lessonlib.results import Impl, Op, Results, is_sweep

FUSED_OPS = (Op.SWIGLU, Op.ADD_RMS_NORM, Op.APPLY_ROPE)
IMPLS = (Impl.EAGER, Impl.COMPILE, Impl.LESSONLIB)


def _timed_like_live(record: dict) -> bool:
    """Records timed as ``live_gbps`` times (``measure.time_fn``): not a sweep, not the per-call regime (calls in a
    Python loop, launch overhead included: lesson 01's per-call figure)."""
    return record["impl"] in IMPLS and not is_sweep(record["impl"]) and "regime" not in record


def cases(recorded: Results) -> dict[str, tuple[str, dict]]:
    """Every (op, shape) of FUSED_OPS the recorded run timed for all of IMPLS as ``live_gbps`` times them, by a
    label such as "swiglu, T=8192"."""
    found = {}
    for op in FUSED_OPS:
        shapes = [r["shape"] for r in recorded.select(op=op, impl=Impl.LESSONLIB) if _timed_like_live(r)]
        for shape in sorted(shapes, key=lambda s: s["T"]):
            if set(recorded_gbps(recorded, op, shape)) == set(IMPLS):
                found[f"{op}, T={shape['T']}"] = (op, shape)
    return found


def recorded_gbps(recorded: Results, op: str, shape: dict) -> dict[str, float]:
    """GB/s of each implementation at this op and shape in the recorded run."""
    return {r["impl"]: r["gbps"] for r in recorded.select(op=op, **shape) if _timed_like_live(r)}


def _inputs(op: str, shape: dict, dtype: torch.dtype) -> tuple:
    device = runtime.device()

    def randn(*size):
        return torch.randn(*size, device=device, dtype=dtype)

    if op == Op.SWIGLU:
        return randn(shape["T"], shape["I"]), randn(shape["T"], shape["I"])
    if op == Op.ADD_RMS_NORM:
        return randn(shape["T"], shape["H"]), randn(shape["T"], shape["H"]), randn(shape["H"])
    b, h, hkv, t, d = (shape[k] for k in ("B", "H", "Hkv", "T", "D"))
    angles = torch.rand(t, d // 2, device=device, dtype=torch.float32) * 6.28
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    return randn(b, h, t, d), randn(b, hkv, t, d), cos, sin


def _fused_bytes(op: str, shape: dict, itemsize: int) -> int:
    if op == Op.SWIGLU:
        return traffic.swiglu(shape["T"], shape["I"], itemsize).fused.bytes
    if op == Op.ADD_RMS_NORM:
        return traffic.add_rms_norm(shape["T"], shape["H"], itemsize).fused.bytes
    return traffic.apply_rope(shape["B"], shape["H"], shape["Hkv"], shape["T"], shape["D"], itemsize).fused.bytes


def calls(op: str, shape: dict) -> tuple[dict, tuple, object, int]:
    """Each implementation of ``op`` (eager PyTorch, torch.compile, lessonlib) as a call on fresh inputs of ``shape``
    in ``runtime.dtype()``, the inputs, a check of lessonlib's output against float64 (it raises when wrong; run it
    before timing) and the fused kernel's bytes, as the recorded run counts them."""
    from lessonlib.testing import check_close, to_float64

    if op not in FUSED_OPS:
        raise ValueError(f"measured.calls: op must be one of {FUSED_OPS}, got {op!r}")
    dtype = runtime.dtype()
    args = _inputs(op, shape, dtype)
    fns = {Impl.EAGER: getattr(reference, op), Impl.COMPILE: torch.compile(getattr(reference, op), dynamic=False),
           Impl.LESSONLIB: getattr(ops, op)}

    def check():
        outs, truths, lows = (fns[Impl.LESSONLIB](*args), getattr(reference, op)(*to_float64(*args)),
                              getattr(reference, op)(*args))
        for i, (out, truth, low) in enumerate(zip(*(o if isinstance(o, tuple) else (o,) for o in (outs, truths, lows)))):
            check_close(f"{op} output {i}", out, truth, low)

    return fns, args, check, _fused_bytes(op, shape, torch.finfo(dtype).bits // 8)


def live_gbps(op: str, shape: dict) -> dict[str, float]:
    """GB/s of each implementation of ``op`` at ``shape``, and of a copy of the same bytes (``Impl.COPY``, this
    GPU's ceiling), measured on this GPU in ``runtime.dtype()`` (the bytes: the fused kernel's, as the recorded run
    counts them), lessonlib's output checked against float64 first. Raises RuntimeError without a GPU: the
    interpreter's timings say nothing about a GPU."""
    from lessonlib.measure import compare_bandwidth

    if op not in FUSED_OPS:
        raise ValueError(f"live_gbps: op must be one of {FUSED_OPS}, got {op!r}")
    if not runtime.on_gpu():
        raise RuntimeError("live_gbps: measuring needs a GPU (Triton's interpreter times Python, not a kernel)")
    fns, args, check, nbytes = calls(op, shape)
    check()
    return compare_bandwidth(fns, *args, nbytes=nbytes)


# --- int8 weights (lesson 01's dequant_matmul) against the 16-bit GEMM a model would otherwise run ---------------

INT8_IMPLS = (Impl.LINEAR_16BIT, Impl.EAGER, Impl.LESSONLIB)


def int8_weight_rows(extras: Results) -> list[dict]:
    """One row per M of the recorded dequant_matmul layer: the three times, the bytes each way must move (the 16-bit
    GEMM reads the 16-bit weight; the int8 kernel, the int8 weight and the scales: ``traffic.dequant_matmul``), the
    16-bit GEMM's FLOPs per byte (its arithmetic intensity) and the run's ridge point (matmul rate over copy rate)."""
    ridge = extras.ceilings["matmul_tflops"] * 1e12 / (extras.ceilings["bandwidth_gbs"] * 1e9)
    rows = []
    for record in extras.select(op=Op.DEQUANT_MATMUL, impl=Impl.LESSONLIB):
        m, n, k = (record["shape"][d] for d in "MNK")
        us = {impl: extras.one(op=Op.DEQUANT_MATMUL, impl=impl, M=m, N=n, K=k)["us"] for impl in INT8_IMPLS}
        bytes_16bit = 2 * (m * k + n * k + m * n)
        rows.append(dict(M=m, N=n, K=k, us=us, bytes_16bit=bytes_16bit,
                         bytes_int8=traffic.dequant_matmul(m, n, k).fused.bytes, flops=2 * m * n * k,
                         intensity=2 * m * n * k / bytes_16bit, ridge=ridge))
    return sorted(rows, key=lambda row: row["M"])


def print_int8_weights(extras: Results) -> None:
    """The table lesson 01 reads: where int8 weights win against F.linear on the 16-bit weight, and where they lose.
    A rate is GB/s of the bytes that way must move where the 16-bit GEMM lies below the ridge point, TFLOP/s above.
    The last columns: F.linear's time over the int8 kernel's, and eager's (both above 1 where the kernel is faster)."""
    rows = int8_weight_rows(extras)
    print(f"x (M, {rows[0]['K']}) @ W.T with W ({rows[0]['N']}, {rows[0]['K']}); "
          f"this run's ridge point: {rows[0]['ridge']:.0f} FLOP/byte")
    print(f"{'M':>5} {'FLOP/B':>6}  {'F.linear, 16-bit W':>22}  {'eager int8':>9}  {'lessonlib int8':>22}  "
          f"{'F.linear/':>9} {'eager/':>6}")
    print(f"{'':>5} {'':>6}  {'':>22}  {'':>9}  {'':>22}  {'int8':>9} {'int8':>6}")
    for row in rows:
        bound = row["intensity"] > row["ridge"]

        def rate(us, nbytes):
            return f"{row['flops'] / us / 1e6:4.0f} TFLOP/s" if bound else f"{nbytes / us / 1e3:4.0f} GB/s   "

        linear, eager, int8 = (row["us"][impl] for impl in INT8_IMPLS)
        print(f"{row['M']:5d} {row['intensity']:6.0f}  {linear:6.1f} µs {rate(linear, row['bytes_16bit'])}  "
              f"{eager:6.1f} µs  {int8:6.1f} µs {rate(int8, row['bytes_int8'])}  {linear / int8:8.2f}x "
              f"{eager / int8:5.2f}x")
