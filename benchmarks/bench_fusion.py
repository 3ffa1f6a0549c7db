"""Lesson 01's benchmark: fused kernels against eager PyTorch, torch.compile and the copy ceiling, on one GPU.

    python benchmarks/bench_fusion.py --out lessonlib/results/fusion-h200.json

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

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from lessonlib import ops, reference, runtime, traffic  # noqa: E402
from lessonlib.measure import Ceilings, count_launches, measure_ceilings, time_copy, time_fn  # noqa: E402
from lessonlib.ops.add_rms_norm import TWO_PASS_BLOCK, _add_rms_norm_kernel, add_rms_norm_backward  # noqa: E402
from lessonlib.ops._common import check_tensors, next_power_of_2, num_warps_for  # noqa: E402
from lessonlib.ops.add_rms_norm import add_rms_norm_forward  # noqa: E402
from lessonlib.ops.swiglu import _swiglu_kernel, swiglu_backward, swiglu_forward  # noqa: E402
from lessonlib.results import Results, environment  # noqa: E402
from lessonlib.testing import check_close, check_gradients, poisoned_outputs, to_float64  # noqa: E402


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


def per_call_us(fn, calls):
    """Time per call when calls run back to back, as in a decode loop: launch overhead included."""
    if not runtime.on_gpu():
        return time_fn(fn).median_us
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(samples)[len(samples) // 2]


def compiled(fn):
    return torch.compile(fn, dynamic=False) if runtime.on_gpu() else fn


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results file to write (JSON)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any mode: tests this script")
    args = parser.parse_args()
    smoke = args.smoke
    if not smoke and not runtime.on_gpu():
        sys.exit("bench_fusion.py needs a GPU (use --smoke to test the script on CPU)")
    torch._dynamo.config.cache_size_limit = 64  # one compiled graph per (op, T): no silent fallback to eager

    dtype = runtime.dtype()  # bfloat16 where the GPU has it, float16 on a T4 and in the interpreter
    itemsize = torch.tensor([], dtype=dtype).element_size()
    dname = str(dtype).removeprefix("torch.")
    T, H, I = (16, 256, 384) if smoke else (8192, 4096, 14336)
    records, notes = [], {}

    def record(op, impl, shape, us, nbytes=None, **extra):
        rec = {"op": op, "impl": impl, "shape": shape, "dtype": dname, "us": round(us, 3)}
        if nbytes is not None:
            rec["bytes"] = nbytes
            rec["gbps"] = round(nbytes / (us * 1e-6) / 1e9, 1)
        rec.update(extra)
        records.append(rec)
        print(f"{op:14s} {impl:28s} {str(shape):40s} {us:10.2f} us" + (f" {rec['gbps']:8.0f} GB/s" if nbytes else ""))
        return rec

    check_ops(dtype, T, H, I)

    # --- the two ceilings ------------------------------------------------------------------------------------
    if runtime.on_gpu():
        ceilings = measure_ceilings()
    else:
        ceilings = Ceilings(float("nan"), float("nan"), "not measured (smoke run)")
    print(f"ceilings: copy {ceilings.bandwidth_gbs:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")

    # --- large T: bandwidth against the copy ceiling ---------------------------------------------------------
    gate, up = randn(T, I, dtype=dtype), randn(T, I, dtype=dtype)
    sw_bytes = traffic.swiglu(T, I, itemsize).fused.bytes
    shape = {"T": T, "I": I}
    record("copy", "copy (same bytes)", shape, time_copy(sw_bytes).median_us, sw_bytes)
    record("swiglu", "lessonlib", shape, time_fn(ops.swiglu, gate, up).median_us, sw_bytes)
    record("swiglu", "eager", shape, time_fn(reference.swiglu, gate, up).median_us, sw_bytes)
    record("swiglu", "torch.compile", shape, time_fn(compiled(reference.swiglu), gate, up).median_us, sw_bytes)
    out = torch.empty_like(gate)
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            def run(block=block, warps=warps):
                grid = (T * -(-I // block),)
                _swiglu_kernel[grid](gate, up, out, I, I, I, I, BLOCK=block, num_warps=warps)
            record("swiglu", f"sweep BLOCK={block} warps={warps}", shape, time_fn(run).median_us, sw_bytes, sweep=True)
    del gate, up, out

    x, res, w = randn(T, H, dtype=dtype), randn(T, H, dtype=dtype), randn(H, dtype=dtype)
    rn_bytes = traffic.add_rms_norm(T, H, itemsize).fused.bytes
    shape = {"T": T, "H": H}
    record("copy", "copy (same bytes)", shape, time_copy(rn_bytes).median_us, rn_bytes)
    record("add_rms_norm", "lessonlib", shape, time_fn(ops.add_rms_norm, x, res, w).median_us, rn_bytes)
    record("add_rms_norm", "eager", shape, time_fn(reference.add_rms_norm, x, res, w).median_us, rn_bytes)
    record("add_rms_norm", "torch.compile", shape, time_fn(compiled(reference.add_rms_norm), x, res, w).median_us, rn_bytes)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    block = next_power_of_2(H)
    for warps in (1, 2, 4, 8, 16):
        def run(warps=warps):
            _add_rms_norm_kernel[(T,)](x, res, w, out, res_out, H, H, H, 1e-6, BLOCK=block, ONE_PASS=True, num_warps=warps)
        record("add_rms_norm", f"sweep warps={warps}", shape, time_fn(run).median_us, rn_bytes, sweep=True)
    del x, res, w, out, res_out

    # --- the backward: fused gradient kernels against eager autograd and torch.compile's backward ---------------
    gate, up = randn(T, I, dtype=dtype), randn(T, I, dtype=dtype)
    grad = randn(T, I, dtype=dtype)
    shape = {"T": T, "I": I}
    model = traffic.swiglu_backward(T, I, itemsize)
    record("swiglu_backward", "lessonlib (kernel)", shape, time_fn(swiglu_backward, grad, gate, up).median_us,
           model.fused.bytes)
    for impl, fn in (("lessonlib (autograd)", ops.swiglu), ("eager", reference.swiglu),
                     ("torch.compile", compiled(reference.swiglu))):
        record("swiglu_backward", impl, shape, time_fn(backward_only(fn, gate, up)).median_us, model.fused.bytes,
               eager_model_bytes=model.eager.bytes)
    del gate, up, grad

    x, res, w = randn(T, H, dtype=dtype), randn(T, H, dtype=dtype), randn(H, dtype=dtype)
    grad, grad_res = randn(T, H, dtype=dtype), randn(T, H, dtype=dtype)
    _, h = add_rms_norm_forward(x, res, w)
    shape = {"T": T, "H": H}
    programs_per_sm = (1, 2) if smoke else (1, 2, 4, 8)
    sms = runtime.gpu_profile().multiprocessors if runtime.on_gpu() else 2
    default_model = traffic.add_rms_norm_backward(T, H, itemsize, programs=min(T, 2 * sms))
    record("add_rms_norm_backward", "lessonlib (kernel)", shape,
           time_fn(add_rms_norm_backward, grad, grad_res, h, w).median_us, default_model.fused.bytes)
    for per_sm in programs_per_sm:
        programs = min(T, per_sm * sms)
        model = traffic.add_rms_norm_backward(T, H, itemsize, programs=programs)
        record("add_rms_norm_backward", f"sweep programs={per_sm} per SM", shape,
               time_fn(lambda p=programs: add_rms_norm_backward(grad, grad_res, h, w, programs=p)).median_us,
               model.fused.bytes, sweep=True)
    for impl, fn in (("lessonlib (autograd)", ops.add_rms_norm), ("eager", reference.add_rms_norm),
                     ("torch.compile", compiled(reference.add_rms_norm))):
        record("add_rms_norm_backward", impl, shape, time_fn(backward_only(fn, x, res, w)).median_us,
               default_model.fused.bytes, eager_model_bytes=default_model.eager.bytes)
    del x, res, w, grad, grad_res, h

    # --- small T: launch overhead ----------------------------------------------------------------------------
    token_counts = (1, 4, 16) if smoke else (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)
    sw_compiled, rn_compiled = compiled(reference.swiglu), compiled(reference.add_rms_norm)
    for t in token_counts:
        gate, up = randn(t, I, dtype=dtype), randn(t, I, dtype=dtype)
        x, res, w = randn(t, H, dtype=dtype), randn(t, H, dtype=dtype), randn(H, dtype=dtype)
        calls = 5 if smoke else 200
        for impl, fn in (("lessonlib", ops.swiglu), ("eager", reference.swiglu), ("torch.compile", sw_compiled)):
            record("swiglu", impl, {"T": t, "I": I}, per_call_us(lambda: fn(gate, up), calls),
                   traffic.swiglu(t, I, itemsize).fused.bytes, regime="per call, back to back")
        for impl, fn in (("lessonlib", ops.add_rms_norm), ("eager", reference.add_rms_norm), ("torch.compile", rn_compiled)):
            record("add_rms_norm", impl, {"T": t, "H": H}, per_call_us(lambda: fn(x, res, w), calls),
                   traffic.add_rms_norm(t, H, itemsize).fused.bytes, regime="per call, back to back")

    # --- where a decode-size call's time goes: validation, allocation, Triton's launch, the kernel -------------
    gate, up = randn(1, I, dtype=dtype), randn(1, I, dtype=dtype)
    out = torch.empty_like(gate)
    block = min(next_power_of_2(I), 2048)
    calls = 5 if smoke else 1000
    steps = {
        "check_tensors only": lambda: check_tensors("swiglu", gate=gate, up=up),
        "torch.empty only": lambda: torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
        "bare Triton launch (inputs ready)": lambda: _swiglu_kernel[(-(-I // block),)](gate, up, out, I, I, I, I, BLOCK=block, num_warps=num_warps_for(block)),
        "lessonlib.ops.swiglu": lambda: ops.swiglu(gate, up),
        "swiglu_forward (the launcher alone)": lambda: swiglu_forward(gate, up),
        "torch.ops.lessonlib.swiglu (custom op dispatch)": lambda: torch.ops.lessonlib.swiglu(gate, up),
        "eager silu·mul": lambda: reference.swiglu(gate, up),
    }
    for impl, fn in steps.items():
        record("launch_overhead", impl, {"T": 1, "I": I}, per_call_us(fn, calls), regime="per call, back to back")
    x, res, w = randn(1, H, dtype=dtype), randn(1, H, dtype=dtype), randn(H, dtype=dtype)
    for impl, fn in {"lessonlib.ops.add_rms_norm": lambda: ops.add_rms_norm(x, res, w),
                     "add_rms_norm_forward (the launcher alone)": lambda: add_rms_norm_forward(x, res, w),
                     "torch.ops.lessonlib.add_rms_norm (custom op dispatch)":
                         lambda: torch.ops.lessonlib.add_rms_norm(x, res, w, 1e-6)}.items():
        record("launch_overhead", impl, {"T": 1, "H": H}, per_call_us(fn, calls), regime="per call, back to back")

    # --- apply_rope: Llama-8B-like attention shapes ----------------------------------------------------------
    heads, kv_heads, head_dim = (4, 2, 32) if smoke else (32, 8, 128)
    rope_compiled = compiled(reference.apply_rope)
    for t in ((1, 16) if smoke else (1, 128, 2048, 8192)):
        q, k = randn(1, heads, t, head_dim, dtype=dtype), randn(1, kv_heads, t, head_dim, dtype=dtype)
        cos, sin = reference.rope_cos_sin(torch.arange(t, device=runtime.device()), head_dim, dtype=dtype)
        nbytes = traffic.apply_rope(1, heads, kv_heads, t, head_dim, itemsize).fused.bytes
        shape = {"B": 1, "H": heads, "Hkv": kv_heads, "T": t, "D": head_dim}
        for impl, fn in (("lessonlib", ops.apply_rope), ("eager", reference.apply_rope), ("torch.compile", rope_compiled)):
            record("apply_rope", impl, shape, time_fn(fn, q, k, cos, sin).median_us, nbytes)

    # --- the whole GatedMLP: fusion saves the elementwise part only ------------------------------------------
    for t in ((4,) if smoke else (1, 128, 2048, 8192)):
        mlp = reference.GatedMLP(H, I, device=runtime.device(), dtype=dtype)
        fused = ops.FusedGatedMLP(mlp)
        x = randn(t, H, dtype=dtype)
        shape = {"T": t, "H": H, "I": I}
        flops = traffic.gated_mlp(t, H, I, itemsize).eager.flops
        with torch.no_grad():
            for impl, fn in (("eager", mlp), ("lessonlib (gate_up GEMM + swiglu)", fused), ("torch.compile", compiled(mlp))):
                us = time_fn(fn, x).median_us
                record("gated_mlp", impl, shape, us, tflops=round(flops / (us * 1e-6) / 1e12, 1))
            gemm = randn(t, 2 * I, dtype=dtype)
            g, u = gemm.chunk(2, dim=-1)
            record("gated_mlp", "of which: swiglu kernel", shape, time_fn(ops.swiglu, g, u).median_us)
            record("gated_mlp", "of which: eager silu·mul", shape, time_fn(reference.swiglu, g, u).median_us)

    # --- launch counts ---------------------------------------------------------------------------------------
    t = 16 if smoke else 128
    gate, up = randn(t, I, dtype=dtype), randn(t, I, dtype=dtype)
    x, res, w = randn(t, H, dtype=dtype), randn(t, H, dtype=dtype), randn(H, dtype=dtype)
    q, k = randn(1, heads, t, head_dim, dtype=dtype), randn(1, kv_heads, t, head_dim, dtype=dtype)
    cos, sin = reference.rope_cos_sin(torch.arange(t, device=runtime.device()), head_dim, dtype=dtype)
    mlp = reference.GatedMLP(H, I, device=runtime.device(), dtype=dtype)
    launches = {}
    with torch.no_grad():
        for op, impls in {
            "swiglu": {"eager": (reference.swiglu, (gate, up)), "lessonlib": (ops.swiglu, (gate, up)), "torch.compile": (sw_compiled, (gate, up))},
            "add_rms_norm": {"eager": (reference.add_rms_norm, (x, res, w)), "lessonlib": (ops.add_rms_norm, (x, res, w)), "torch.compile": (rn_compiled, (x, res, w))},
            "apply_rope": {"eager": (reference.apply_rope, (q, k, cos, sin)), "lessonlib": (ops.apply_rope, (q, k, cos, sin)), "torch.compile": (rope_compiled, (q, k, cos, sin))},
            "gated_mlp": {"eager": (mlp, (x,)), "lessonlib": (ops.FusedGatedMLP(mlp), (x,)), "torch.compile": (compiled(mlp), (x,))},
        }.items():
            launches[op] = {}
            for impl, (fn, fn_args) in impls.items():
                count = count_launches(fn, *fn_args)
                launches[op][impl] = {"total": count.total, "kernels": dict(count.by_name)}
                print(f"launches {op:14s} {impl:14s} {count.total}")
    notes["launch_counts"] = {"T": t, "what": "GPU kernels per call, torch.profiler", "counts": launches}

    # --- register pressure: one program keeping a whole row in registers -------------------------------------
    if runtime.on_gpu():
        pressure = []
        rows = 8192
        for width in (4096, 8192, 16384, 32768, 65536):
            x, res, w = randn(rows, width, dtype=dtype), randn(rows, width, dtype=dtype), randn(width, dtype=dtype)
            out, res_out = torch.empty_like(x), torch.empty_like(x)
            nbytes = traffic.add_rms_norm(rows, width, itemsize).fused.bytes
            for one_pass, block in ((True, width), (False, TWO_PASS_BLOCK)):
                def run(one_pass=one_pass, block=block):
                    return _add_rms_norm_kernel[(rows,)](
                        x, res, w, out, res_out, width, width, width, 1e-6, BLOCK=block, ONE_PASS=one_pass, num_warps=16)
                kernel = run()
                us = time_fn(run).median_us
                entry = {"H": width, "one_pass": one_pass, "BLOCK": block, "num_warps": 16, "us": round(us, 2),
                         "gbps": round(nbytes / (us * 1e-6) / 1e9, 1),
                         "registers_per_thread": kernel.n_regs, "spilled_registers": kernel.n_spills}
                pressure.append(entry)
                print("register pressure", entry)
            del x, res, w, out, res_out
        notes["register_pressure"] = {"T": rows, "op": "add_rms_norm", "rows": pressure}

    results = Results("fusion", " ".join(["python", *sys.argv]), environment(),
                      {"bandwidth_gbs": round(ceilings.bandwidth_gbs, 1), "matmul_tflops": round(ceilings.matmul_tflops, 1)},
                      records, notes)
    print("wrote", results.save(args.out))


if __name__ == "__main__":
    main()
