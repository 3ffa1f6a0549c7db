"""Lesson 01's further fusions, against eager PyTorch and torch.compile, on one GPU:

    python -m benchmarks.bench_fusion_extras --out lessonlib/results/fusion-extras-h200.json

Checks every op against its float64 reference at the benchmark's own sizes first, then times:
  * bias_swiglu (T=8192, I=14336): bias + activation + multiply, one kernel against eager's four;
  * dequant_matmul: a 4096 -> 14336 linear layer with an int8 weight and per-row scales, at decode (M=1, 16) and
    prefill (M=2048), against eager (dequantise, scale, GEMM), torch.compile, and F.linear on the 16-bit weight;
  * absmax_normalize (8192 x 4096 elements): a reduction that needs a grid-wide barrier, done in two launches and in
    one program, against eager and torch.compile;
  * launch counts from torch.profiler for each implementation (notes["launch_counts"]).
``--smoke`` runs tiny sizes in whatever mode lessonlib picks (the interpreter on CPU), to test this script.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lessonlib import bench, ops, reference, runtime, traffic
from lessonlib.bench import Case
from lessonlib.measure import count_launches, measure_ceilings
from lessonlib.ops.absmax_normalize import partial_programs
from lessonlib.results import Benchmark, Ceilings, Impl, Op
from lessonlib.testing import (check_close, dequant_matmul_magnitude, poisoned_outputs, swiglu_allowance,
                               to_float64)

# (T, I) of the bias op; (N, K) of the quantised layer and its M; elements of the normalised tensor.
SIZES = dict(bias=(8192, 14336), layer=(14336, 4096), tokens=(1, 16, 2048), elements=8192 * 4096)
SMOKE_SIZES = dict(bias=(4, 384), layer=(96, 64), tokens=(1, 16), elements=5000)


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=runtime.device(), dtype=torch.float32) * scale).to(dtype)


def compiled(fn):
    return torch.compile(fn, dynamic=False) if runtime.on_gpu() else fn


def bias_swiglu_case(dtype, sizes):
    T, I = sizes["bias"]
    gate, up, gate_bias, up_bias = randn(T, I, dtype=dtype, scale=3), randn(T, I, dtype=dtype), randn(I, dtype=dtype), \
        randn(I, dtype=dtype)

    def check():
        with poisoned_outputs():
            out = ops.bias_swiglu(gate, up, gate_bias, up_bias)
        f64 = to_float64(gate, up, gate_bias, up_bias)
        check_close("bias_swiglu", out, reference.bias_swiglu(*f64), reference.bias_swiglu(gate, up, gate_bias, up_bias),
                    allowance=swiglu_allowance(f64[0] + f64[2], f64[1] + f64[3]))

    args = (gate, up, gate_bias, up_bias)
    yield Case(Op.BIAS_SWIGLU, {"T": T, "I": I}, {impl: (lambda fn=fn: fn(*args)) for impl, fn in (
        (Impl.LESSONLIB, ops.bias_swiglu), (Impl.EAGER, reference.bias_swiglu),
        (Impl.COMPILE, compiled(reference.bias_swiglu)))},
        check, nbytes=traffic.bias_swiglu(T, I, dtype.itemsize).fused.bytes)


def dequant_matmul_cases(dtype, sizes):
    N, K = sizes["layer"]
    weight_int8, scales = reference.quantise_int8(randn(N, K, dtype=dtype, scale=K ** -0.5))
    weight_16bit = weight_int8.to(dtype) * scales[:, None]  # the unquantised peer reads this
    eager_compiled = compiled(reference.dequant_matmul)
    for m in sizes["tokens"]:
        x = randn(m, K, dtype=dtype)

        def check(x=x):
            with poisoned_outputs():
                out = ops.dequant_matmul(x, weight_int8, scales)
            x64, s64 = to_float64(x, scales)
            check_close("dequant_matmul", out, reference.dequant_matmul(x64, weight_int8, s64),
                        reference.dequant_matmul(x, weight_int8, scales),
                        magnitude=dequant_matmul_magnitude(x, weight_int8, scales))

        model = traffic.dequant_matmul(m, N, K, dtype.itemsize)
        yield Case(Op.DEQUANT_MATMUL, {"M": m, "N": N, "K": K}, {
            Impl.LESSONLIB: lambda x=x: ops.dequant_matmul(x, weight_int8, scales),
            Impl.EAGER: lambda x=x: reference.dequant_matmul(x, weight_int8, scales),
            Impl.COMPILE: lambda x=x: eager_compiled(x, weight_int8, scales),
            Impl.LINEAR_16BIT: lambda x=x: F.linear(x, weight_16bit)},
            check, nbytes=model.fused.bytes, flops=model.fused.flops)


def absmax_normalize_case(dtype, sizes):
    n = sizes["elements"]
    x = randn(n, dtype=dtype, scale=3)

    def check():
        for strategy in ("two_launches", "one_program"):
            with poisoned_outputs():
                out = ops.absmax_normalize(x, strategy)
            check_close(f"absmax_normalize {strategy}", out, reference.absmax_normalize(x.double()),
                        reference.absmax_normalize(x))

    model = traffic.absmax_normalize(n, dtype.itemsize, partial_programs(n))
    yield Case(Op.ABSMAX_NORMALIZE, {"n": n}, {
        Impl.TWO_LAUNCHES: lambda: ops.absmax_normalize(x, "two_launches"),
        Impl.ONE_PROGRAM: lambda: ops.absmax_normalize(x, "one_program"),
        Impl.EAGER: lambda: reference.absmax_normalize(x),
        Impl.COMPILE: (lambda f=compiled(reference.absmax_normalize): f(x))},
        check, nbytes=model.fused.bytes)


def launch_counts(dtype, sizes):
    """Kernel launches per call of each implementation, from torch.profiler: the run's notes["launch_counts"]. At the
    cases' own shapes, so that torch.compile reuses the graphs it built for them."""
    t, i = sizes["bias"]
    n, k = sizes["layer"]
    weight_int8, scales = reference.quantise_int8(randn(n, k, dtype=dtype))
    calls = {
        Op.BIAS_SWIGLU: (reference.bias_swiglu, {Impl.LESSONLIB: ops.bias_swiglu},
                         (randn(t, i, dtype=dtype), randn(t, i, dtype=dtype), randn(i, dtype=dtype), randn(i, dtype=dtype))),
        Op.DEQUANT_MATMUL: (reference.dequant_matmul, {Impl.LESSONLIB: ops.dequant_matmul},
                            (randn(16, k, dtype=dtype), weight_int8, scales)),
        Op.ABSMAX_NORMALIZE: (reference.absmax_normalize, {
            Impl.TWO_LAUNCHES: ops.absmax_normalize,
            Impl.ONE_PROGRAM: lambda x: ops.absmax_normalize(x, "one_program")}, (randn(sizes["elements"], dtype=dtype),)),
    }
    counts = {}
    with torch.no_grad():
        for op, (eager, ours, args) in calls.items():
            impls = {Impl.EAGER: eager, **ours, Impl.COMPILE: compiled(eager)}
            counts[op] = {impl: count_launches(fn, *args).total for impl, fn in impls.items()}
            print(f"launches {op:18s} {counts[op]}")
    return {"what": "GPU kernels per call, torch.profiler", "counts": counts}


def main():
    args = bench.parse_args(__doc__, "bench_fusion_extras.py")
    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per (op, shape): no silent fallback to eager
    run = bench.Run(Benchmark.FUSION_EXTRAS, smoke=args.smoke, check_only=args.check)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    nan = float("nan")
    ceilings = measure_ceilings() if runtime.on_gpu() else Ceilings(nan, nan, "not measured (smoke run)")
    with torch.no_grad():
        run.cases(bias_swiglu_case(run.dtype, sizes))
        run.cases(dequant_matmul_cases(run.dtype, sizes))
        run.cases(absmax_normalize_case(run.dtype, sizes))
        if not run.check_only:
            run.notes["launch_counts"] = launch_counts(run.dtype, sizes)
    run.save(args.out, ceilings)


if __name__ == "__main__":
    main()
