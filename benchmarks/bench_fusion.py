"""Lesson 01's benchmark: fused kernels against eager PyTorch, torch.compile and the copy ceiling, on one GPU.

    python -m benchmarks.bench_fusion --out lessonlib/results/fusion-h200.json

Checks every op against its reference first (on the GPU, bf16 included), then times, in this one run:
  * the ceilings: device-to-device copy bandwidth and bf16 matmul rate;
  * swiglu (T=8192, I=14336) and add_rms_norm (T=8192, H=4096), bf16: lessonlib, eager, torch.compile, and a
    sweep of the kernels' block size / warps (the launchers' heuristics come from it);
  * the backward: swiglu's and add_rms_norm's fused gradient kernels (checked against float64 autograd first)
    against eager autograd and torch.compile's backward, each timed as the backward pass alone (the graph is
    built once, then differentiated with retain_graph=True), plus a sweep of add_rms_norm backward's programs;
  * the small-T regime, T = 1 ... 8192, time per call in a loop of back-to-back calls (launch overhead included);
  * apply_rope and the whole GatedMLP (where fusion stops paying: GEMMs dominate);
  * launch counts from torch.profiler for each implementation;
  * register pressure: add_rms_norm forced to keep ever wider rows in registers (registers, spills, bandwidth).
``--smoke`` runs tiny sizes in whatever mode lessonlib picks (the interpreter on CPU), to test this script.
"""

from __future__ import annotations

import torch

from lessonlib import bench, ops, reference, runtime, traffic
from lessonlib.bench import Case
from lessonlib.measure import copy_call, count_launches, measure_ceilings, time_back_to_back, time_fn
from lessonlib.ops._common import check_tensors, next_power_of_2, num_warps_for
from lessonlib.ops.add_rms_norm import (TWO_PASS_BLOCK, add_rms_norm_backward, add_rms_norm_forward,
                                        compiled_forward)
from lessonlib.ops.swiglu import _swiglu_kernel, swiglu_backward, swiglu_forward
from lessonlib.results import (FUSION_SWEEP_PREFIX, Benchmark, Ceilings, Impl, Op, Regime,
                               sweep_label)
from lessonlib.testing import check_close, check_gradients, poisoned_outputs, to_float64

SIZES, SMOKE_SIZES = (8192, 4096, 14336), (16, 256, 384)  # tokens T, hidden H, intermediate I
# The launchers' tuning knobs (their config=), each point checked against float64 before it is timed.
SWIGLU_SWEEP = [dict(BLOCK=block, num_warps=warps) for block in (1024, 2048, 4096, 8192) for warps in (4, 8, 16)]
ADD_RMS_NORM_WARPS = (1, 2, 4, 8, 16)
PROGRAMS_PER_SM, SMOKE_PROGRAMS_PER_SM = (1, 2, 4, 8), (1, 2)
TOKEN_COUNTS, SMOKE_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192), (1, 4, 16)
ROPE_HEADS, SMOKE_ROPE_HEADS = (32, 8, 128), (4, 2, 32)  # query heads, KV heads, head_dim
ROPE_TOKENS, SMOKE_ROPE_TOKENS = (1, 128, 2048, 8192), (1, 16)
MLP_TOKENS, SMOKE_MLP_TOKENS = (1, 128, 2048, 8192), (4,)
REGISTER_ROWS, REGISTER_WIDTHS, REGISTER_WARPS = 8192, (4096, 8192, 16384, 32768, 65536), 16


def randn(*shape, dtype):
    return torch.randn(*shape, device=runtime.device(), dtype=torch.float32).to(dtype)


def check_ops(dtype, tokens, hidden, intermediate):
    """The timed code must be right: each op against float64 on fresh inputs at the benchmark's own sizes."""
    gate, up = randn(tokens, intermediate, dtype=dtype), randn(tokens, intermediate, dtype=dtype)
    with poisoned_outputs():
        out = ops.swiglu(gate, up)
    check_close("swiglu", out, reference.swiglu(*to_float64(gate, up)), reference.swiglu(gate, up))
    x, res, w = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    with poisoned_outputs():
        out, _ = ops.add_rms_norm(x, res, w)
    check_close("add_rms_norm", out, reference.add_rms_norm(*to_float64(x, res, w))[0], reference.add_rms_norm(x, res, w)[0])
    print(f"checked swiglu and add_rms_norm against float64 at T={tokens}, {dtype}")
    check_gradients("swiglu", ops.swiglu, reference.swiglu, (gate, up), ("gate", "up"))
    check_gradients("add_rms_norm", ops.add_rms_norm, reference.add_rms_norm, (x, res, w, 1e-6),
                    ("x", "residual", "weight", None))
    print(f"checked the gradients of swiglu and add_rms_norm against float64 autograd at T={tokens}, {dtype}")


def backward_only(fn, *args):
    """A function running only the backward pass of ``fn(*args)``: the forward graph is built once here, and each
    call differentiates it again (retain_graph=True), so a timing holds no forward kernel."""
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    inputs = [a for a in leaves if isinstance(a, torch.Tensor)]
    return lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True)


def per_call(calls):
    """A timer: time per call when calls run back to back, as in a decode loop (launch overhead included)."""
    return lambda fn: time_back_to_back(fn, calls)


def compiled(fn):
    return torch.compile(fn, dynamic=False) if runtime.on_gpu() else fn


def checked_configs(name, launcher, args, want, configs):
    """A case's check: every configuration of a sweep against float64 (``want``: (exact, rounded) references)."""

    def check():
        for config in configs:
            got = launcher(*args, config=config)
            check_close(f"{name} {config}", got[0] if isinstance(got, tuple) else got, *want)

    return check


def bandwidth_cases(dtype, sizes):
    """Large T: each op's peers and its launcher's sweep, beside a copy of the same bytes."""
    T, H, I = sizes
    itemsize = dtype.itemsize
    gate, up = randn(T, I, dtype=dtype), randn(T, I, dtype=dtype)
    shape, nbytes = {"T": T, "I": I}, traffic.swiglu(T, I, itemsize).fused.bytes
    yield Case(Op.COPY, shape, {Impl.COPY: copy_call(nbytes)}, nbytes=nbytes)
    yield Case(Op.SWIGLU, shape, {
        Impl.LESSONLIB: lambda: ops.swiglu(gate, up), Impl.EAGER: lambda: reference.swiglu(gate, up),
        Impl.COMPILE: (lambda f=compiled(reference.swiglu): f(gate, up))}, nbytes=nbytes)
    yield Case(Op.SWIGLU, shape, {sweep_label({"BLOCK": c["BLOCK"], "warps": c["num_warps"]}, FUSION_SWEEP_PREFIX):
                                  (lambda c=c: swiglu_forward(gate, up, config=c)) for c in SWIGLU_SWEEP},
               checked_configs("swiglu", swiglu_forward, (gate, up), (reference.swiglu(*to_float64(gate, up)),
                                                                      reference.swiglu(gate, up)), SWIGLU_SWEEP),
               nbytes, fields={"sweep": True})
    del gate, up
    x, res, w = randn(T, H, dtype=dtype), randn(T, H, dtype=dtype), randn(H, dtype=dtype)
    shape, nbytes = {"T": T, "H": H}, traffic.add_rms_norm(T, H, itemsize).fused.bytes
    yield Case(Op.COPY, shape, {Impl.COPY: copy_call(nbytes)}, nbytes=nbytes)
    yield Case(Op.ADD_RMS_NORM, shape, {
        Impl.LESSONLIB: lambda: ops.add_rms_norm(x, res, w), Impl.EAGER: lambda: reference.add_rms_norm(x, res, w),
        Impl.COMPILE: (lambda f=compiled(reference.add_rms_norm): f(x, res, w))}, nbytes=nbytes)
    configs = [dict(BLOCK=next_power_of_2(H), ONE_PASS=True, num_warps=warps) for warps in ADD_RMS_NORM_WARPS]
    yield Case(Op.ADD_RMS_NORM, shape, {sweep_label({"warps": c["num_warps"]}, FUSION_SWEEP_PREFIX):
                                        (lambda c=c: add_rms_norm_forward(x, res, w, config=c)) for c in configs},
               checked_configs("add_rms_norm", add_rms_norm_forward, (x, res, w), (
                   reference.add_rms_norm(*to_float64(x, res, w))[0], reference.add_rms_norm(x, res, w)[0]), configs),
               nbytes, fields={"sweep": True})


def backward_cases(dtype, sizes, programs_per_sm):
    """The fused gradient kernels against eager autograd and torch.compile's backward, the backward pass alone."""
    T, H, I = sizes
    itemsize = dtype.itemsize
    gate, up, grad = randn(T, I, dtype=dtype), randn(T, I, dtype=dtype), randn(T, I, dtype=dtype)
    shape, model = {"T": T, "I": I}, traffic.swiglu_backward(T, I, itemsize)
    yield Case(Op.SWIGLU_BACKWARD, shape, {Impl.LESSONLIB_KERNEL: lambda: swiglu_backward(grad, gate, up)},
               nbytes=model.fused.bytes)
    yield Case(Op.SWIGLU_BACKWARD, shape, {impl: backward_only(fn, gate, up) for impl, fn in (
        (Impl.LESSONLIB_AUTOGRAD, ops.swiglu), (Impl.EAGER, reference.swiglu),
        (Impl.COMPILE, compiled(reference.swiglu)))},
        nbytes=model.fused.bytes, fields={"eager_model_bytes": model.eager.bytes})
    del gate, up, grad
    x, res, w = randn(T, H, dtype=dtype), randn(T, H, dtype=dtype), randn(H, dtype=dtype)
    grad, grad_res = randn(T, H, dtype=dtype), randn(T, H, dtype=dtype)
    _, h = add_rms_norm_forward(x, res, w)
    shape = {"T": T, "H": H}
    sms = runtime.gpu_profile().multiprocessors if runtime.on_gpu() else 2
    model = traffic.add_rms_norm_backward(T, H, itemsize, programs=min(T, 2 * sms))
    yield Case(Op.ADD_RMS_NORM_BACKWARD, shape, {
        Impl.LESSONLIB_KERNEL: lambda: add_rms_norm_backward(grad, grad_res, h, w)}, nbytes=model.fused.bytes)
    for per_sm in programs_per_sm:
        programs = min(T, per_sm * sms)
        label = sweep_label({"programs": per_sm}, FUSION_SWEEP_PREFIX, " per SM")
        yield Case(Op.ADD_RMS_NORM_BACKWARD, shape, {
                   label: lambda p=programs: add_rms_norm_backward(grad, grad_res, h, w, programs=p)},
                   nbytes=traffic.add_rms_norm_backward(T, H, itemsize, programs=programs).fused.bytes,
                   fields={"sweep": True})
    yield Case(Op.ADD_RMS_NORM_BACKWARD, shape, {impl: backward_only(fn, x, res, w) for impl, fn in (
        (Impl.LESSONLIB_AUTOGRAD, ops.add_rms_norm), (Impl.EAGER, reference.add_rms_norm),
        (Impl.COMPILE, compiled(reference.add_rms_norm)))},
        nbytes=model.fused.bytes, fields={"eager_model_bytes": model.eager.bytes})


def per_call_cases(dtype, sizes, token_counts):
    """Small T: time per call of back-to-back calls, where launch overhead, not bytes, is the time."""
    _, H, I = sizes
    sw_compiled, rn_compiled = compiled(reference.swiglu), compiled(reference.add_rms_norm)
    for t in token_counts:
        gate, up = randn(t, I, dtype=dtype), randn(t, I, dtype=dtype)
        x, res, w = randn(t, H, dtype=dtype), randn(t, H, dtype=dtype), randn(H, dtype=dtype)
        yield Case(Op.SWIGLU, {"T": t, "I": I}, {impl: (lambda fn=fn: fn(gate, up)) for impl, fn in (
            (Impl.LESSONLIB, ops.swiglu), (Impl.EAGER, reference.swiglu), (Impl.COMPILE, sw_compiled))},
            nbytes=traffic.swiglu(t, I, dtype.itemsize).fused.bytes, fields={"regime": Regime.PER_CALL})
        yield Case(Op.ADD_RMS_NORM, {"T": t, "H": H}, {impl: (lambda fn=fn: fn(x, res, w)) for impl, fn in (
            (Impl.LESSONLIB, ops.add_rms_norm), (Impl.EAGER, reference.add_rms_norm), (Impl.COMPILE, rn_compiled))},
            nbytes=traffic.add_rms_norm(t, H, dtype.itemsize).fused.bytes, fields={"regime": Regime.PER_CALL})


def launch_overhead_cases(dtype, sizes):
    """Where a decode-size call's time goes: validation, allocation, Triton's launch, the kernel."""
    _, H, I = sizes
    gate, up = randn(1, I, dtype=dtype), randn(1, I, dtype=dtype)
    out = torch.empty_like(gate)
    block = min(next_power_of_2(I), 2048)
    grid = (-(-I // block),)
    yield Case(Op.LAUNCH_OVERHEAD, {"T": 1, "I": I}, {
        Impl.CHECK_TENSORS: lambda: check_tensors("swiglu", gate=gate, up=up),
        Impl.TORCH_EMPTY: lambda: torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
        # The private kernel on purpose: what Triton's launcher alone costs, with nothing of lessonlib around it.
        Impl.BARE_LAUNCH: lambda: _swiglu_kernel[grid](gate, up, out, I, I, I, I, BLOCK=block,
                                                       num_warps=num_warps_for(block)),
        Impl.OPS_SWIGLU: lambda: ops.swiglu(gate, up),
        Impl.SWIGLU_LAUNCHER: lambda: swiglu_forward(gate, up),
        Impl.SWIGLU_CUSTOM_OP: lambda: torch.ops.lessonlib.swiglu(gate, up),
        Impl.EAGER_SILU_MUL: lambda: reference.swiglu(gate, up),
    }, fields={"regime": Regime.PER_CALL})
    x, res, w = randn(1, H, dtype=dtype), randn(1, H, dtype=dtype), randn(H, dtype=dtype)
    yield Case(Op.LAUNCH_OVERHEAD, {"T": 1, "H": H}, {
        Impl.OPS_ADD_RMS_NORM: lambda: ops.add_rms_norm(x, res, w),
        Impl.ADD_RMS_NORM_LAUNCHER: lambda: add_rms_norm_forward(x, res, w),
        Impl.ADD_RMS_NORM_CUSTOM_OP: lambda: torch.ops.lessonlib.add_rms_norm(x, res, w, 1e-6),
    }, fields={"regime": Regime.PER_CALL})


def rope_cases(dtype, heads, token_counts):
    """apply_rope at Llama-8B-like attention shapes."""
    heads, kv_heads, head_dim = heads
    rope_compiled = compiled(reference.apply_rope)
    for t in token_counts:
        q, k = randn(1, heads, t, head_dim, dtype=dtype), randn(1, kv_heads, t, head_dim, dtype=dtype)
        cos, sin = reference.rope_cos_sin(torch.arange(t, device=runtime.device()), head_dim, dtype=dtype)
        yield Case(Op.APPLY_ROPE, {"B": 1, "H": heads, "Hkv": kv_heads, "T": t, "D": head_dim},
                   {impl: (lambda fn=fn: fn(q, k, cos, sin)) for impl, fn in (
                       (Impl.LESSONLIB, ops.apply_rope), (Impl.EAGER, reference.apply_rope),
                       (Impl.COMPILE, rope_compiled))},
                   nbytes=traffic.apply_rope(1, heads, kv_heads, t, head_dim, dtype.itemsize).fused.bytes)


def gated_mlp_cases(dtype, sizes, token_counts):
    """The whole GatedMLP, where fusion saves the elementwise part only (the GEMMs dominate)."""
    _, H, I = sizes
    for t in token_counts:
        mlp = reference.GatedMLP(H, I, device=runtime.device(), dtype=dtype)
        fused, x = ops.FusedGatedMLP(mlp), randn(t, H, dtype=dtype)
        shape = {"T": t, "H": H, "I": I}
        yield Case(Op.GATED_MLP, shape, {impl: (lambda fn=fn: fn(x)) for impl, fn in (
            (Impl.EAGER, mlp), (Impl.FUSED_GATED_MLP, fused), (Impl.COMPILE, compiled(mlp)))},
            flops=traffic.gated_mlp(t, H, I, dtype.itemsize).eager.flops)
        g, u = randn(t, 2 * I, dtype=dtype).chunk(2, dim=-1)
        yield Case(Op.GATED_MLP, shape, {Impl.SHARE_SWIGLU: lambda: ops.swiglu(g, u),
                                         Impl.SHARE_EAGER_SILU_MUL: lambda: reference.swiglu(g, u)})


def launch_counts(dtype, sizes, heads, t):
    """Kernel launches per call of each implementation, from torch.profiler: the run's notes["launch_counts"]."""
    _, H, I = sizes
    heads, kv_heads, head_dim = heads
    gate, up = randn(t, I, dtype=dtype), randn(t, I, dtype=dtype)
    x, res, w = randn(t, H, dtype=dtype), randn(t, H, dtype=dtype), randn(H, dtype=dtype)
    q, k = randn(1, heads, t, head_dim, dtype=dtype), randn(1, kv_heads, t, head_dim, dtype=dtype)
    cos, sin = reference.rope_cos_sin(torch.arange(t, device=runtime.device()), head_dim, dtype=dtype)
    mlp = reference.GatedMLP(H, I, device=runtime.device(), dtype=dtype)
    calls = {Op.SWIGLU: (reference.swiglu, ops.swiglu, (gate, up)),
             Op.ADD_RMS_NORM: (reference.add_rms_norm, ops.add_rms_norm, (x, res, w)),
             Op.APPLY_ROPE: (reference.apply_rope, ops.apply_rope, (q, k, cos, sin)),
             Op.GATED_MLP: (mlp, ops.FusedGatedMLP(mlp), (x,))}
    launches = {}
    with torch.no_grad():
        for op, (eager, fused, args) in calls.items():
            launches[op] = {}
            for impl, fn in ((Impl.EAGER, eager), (Impl.LESSONLIB, fused), (Impl.COMPILE, compiled(eager))):
                count = count_launches(fn, *args)
                launches[op][impl] = {"total": count.total, "kernels": dict(count.by_name)}
                print(f"launches {op:14s} {impl:14s} {count.total}")
    return {"T": t, "what": "GPU kernels per call, torch.profiler", "counts": launches}


def register_pressure(dtype, time=time_fn):
    """add_rms_norm forced to keep ever wider rows in registers (one pass) or not (two passes): registers per
    thread, spills, bandwidth (GPU only): the run's notes["register_pressure"]."""
    rows, pressure = REGISTER_ROWS, []
    for width in REGISTER_WIDTHS:
        x, res, w = randn(rows, width, dtype=dtype), randn(rows, width, dtype=dtype), randn(width, dtype=dtype)
        nbytes = traffic.add_rms_norm(rows, width, dtype.itemsize).fused.bytes
        for one_pass, block in ((True, width), (False, TWO_PASS_BLOCK)):
            config = dict(BLOCK=block, ONE_PASS=one_pass, num_warps=REGISTER_WARPS)
            kernel = compiled_forward(x, res, w, config=config)
            us = time(lambda c=config: add_rms_norm_forward(x, res, w, config=c)).median_us
            entry = {"H": width, "one_pass": one_pass, "BLOCK": block, "num_warps": REGISTER_WARPS, "us": round(us, 2),
                     "gbps": round(nbytes / (us * 1e-6) / 1e9, 1),
                     "registers_per_thread": kernel.n_regs, "spilled_registers": kernel.n_spills}
            pressure.append(entry)
            print("register pressure", entry)
        del x, res, w
    return {"T": rows, "op": Op.ADD_RMS_NORM, "rows": pressure}


def main():
    args = bench.parse_args(__doc__, "bench_fusion.py")
    smoke = args.smoke
    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per (op, T): no silent fallback to eager
    run = bench.Run(Benchmark.FUSION, smoke=smoke, check_only=args.check)
    sizes, heads = (SMOKE_SIZES, SMOKE_ROPE_HEADS) if smoke else (SIZES, ROPE_HEADS)
    check_ops(run.dtype, *sizes)
    nan = float("nan")
    ceilings = measure_ceilings() if runtime.on_gpu() else Ceilings(nan, nan, "not measured (smoke run)")
    print(f"ceilings: copy {ceilings.bandwidth_gbs:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    run.cases(bandwidth_cases(run.dtype, sizes))
    run.cases(backward_cases(run.dtype, sizes, SMOKE_PROGRAMS_PER_SM if smoke else PROGRAMS_PER_SM))
    run.cases(per_call_cases(run.dtype, sizes, SMOKE_TOKEN_COUNTS if smoke else TOKEN_COUNTS),
              timer=per_call(5 if smoke else 200))
    run.cases(launch_overhead_cases(run.dtype, sizes), timer=per_call(5 if smoke else 1000))
    run.cases(rope_cases(run.dtype, heads, SMOKE_ROPE_TOKENS if smoke else ROPE_TOKENS))
    with torch.no_grad():
        run.cases(gated_mlp_cases(run.dtype, sizes, SMOKE_MLP_TOKENS if smoke else MLP_TOKENS))
    if not run.check_only:
        run.notes["launch_counts"] = launch_counts(run.dtype, sizes, heads, 16 if smoke else 128)
    if runtime.on_gpu() and not run.check_only:
        run.notes["register_pressure"] = register_pressure(run.dtype)
    run.save(args.out, ceilings)


if __name__ == "__main__":
    main()
