"""Experiment (not a recorded benchmark): can a Triton kernel read a decode step's weights faster than cuBLAS?

    python -m benchmarks.experiments.decode_linear [--smoke]

At decode a linear layer multiplies a few rows (the batch) by a weight matrix read once: y = x @ W.T with x (M, K),
W (N, K), M = 1..32. The time is the weight read (N * K * 2 bytes). This sweeps a Triton kernel's tiles on the
engine's five weight shapes (Llama-3.2-1B: qkv, o, gate_up, down, output head) at M = 1, 8, 32, against
``torch.nn.functional.linear`` (cuBLAS), each checked against float64 first, each timed with a cold L2 (do_bench
flushes it). It also times gate_up with SwiGLU in the epilogue (one launch, no (M, 2I) intermediate) against
cuBLAS + ``ops.swiglu``, and split-K (K cut in 2-8 ranges, float32 atomics: more programs for the small matrices).
Timed replayed from a CUDA graph with a cold L2. Prints one line per case and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import torch
import torch.nn.functional as F

from lessonlib import ops, runtime  #  (before triton: it chooses the interpreter on a CPU)
from lessonlib.measure import time_fn, time_graph, warm_up_gpu

import triton
import triton.language as tl


@triton.jit
def _decode_linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_DOT: tl.constexpr, SWIGLU: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program (n, s): output columns [n*BLOCK_N, (n+1)*BLOCK_N) for all M rows, over K range s. SWIGLU: W holds
    gate rows then up rows (N = 2I); the program reads both halves' tiles and writes silu(gate) * up, (M, I).
    SPLIT_K > 1: each program adds its partial sums into a float32 y with atomics (y zeroed first)."""
    pid = tl.program_id(0)
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    n_out = N // 2 if SWIGLU else N
    col_ok = cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        w_mask = col_ok[:, None] & (k[None, :] < K)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        if SWIGLU:
            wu = tl.load(w_ptr + (cols[:, None] + n_out) * stride_wn + k[None, :], mask=w_mask, other=0.0)
            if USE_DOT:
                acc_up = tl.dot(x, tl.trans(wu), acc_up)
            else:
                acc_up += tl.sum(x[:, None, :].to(tl.float32) * wu[None, :, :].to(tl.float32), axis=2)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    out_mask = (rows[:, None] < M) & col_ok[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc, mask=out_mask, sem="relaxed")
    else:
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def decode_linear(x, w, config, swiglu=False):
    """config: (BLOCK_N, BLOCK_K, warps, stages, use_dot[, split_k]). Split-K (no SwiGLU): float32 atomics into a
    zeroed buffer, then a cast: three launches."""
    m, k = x.shape
    n = w.shape[0]
    n_out = n // 2 if swiglu else n
    bn, bk, warps, stages, use_dot, *rest = config
    split = rest[0] if rest else 1
    y = torch.zeros(m, n_out, dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    _decode_linear_kernel[(triton.cdiv(n_out, bn), triton.cdiv(k, k_per_split))](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), k_per_split, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        USE_DOT=use_dot, SWIGLU=swiglu, SPLIT_K=split, num_warps=warps, num_stages=stages)
    return y.to(x.dtype) if split > 1 else y


SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "head": (128256, 2048)}
FMA = [(16, 512, 4, 4), (32, 256, 4, 4), (8, 1024, 4, 3), (16, 256, 4, 4, 2), (16, 256, 4, 4, 4),
       (16, 256, 4, 4, 8), (8, 512, 4, 4, 4)]
DOT = [(64, 128, 4, 4), (32, 256, 4, 4), (128, 128, 4, 3), (32, 256, 4, 4, 2), (32, 256, 4, 4, 4), (64, 128, 4, 4, 4)]


def configs(m, swiglu=False):
    fma = [(*c[:4], False, *c[4:]) for c in FMA] if m <= 8 else []
    out = fma + [(*c[:4], True, *c[4:]) for c in DOT]
    return [c for c in out if not (swiglu and len(c) > 5)]  # split-K sums before the epilogue: not with SwiGLU


def reference(x, w, swiglu):
    y = x.double() @ w.double().T
    if swiglu:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    return y


def check(y, truth, x, w):
    """Error allowed: bf16 rounding of the output plus K float32 accumulation roundings of |x||w| products."""
    scale = (x.double().abs() @ w.double().abs().T)
    if y.shape[-1] != scale.shape[-1]:
        scale = scale[..., : y.shape[-1]] * scale[..., y.shape[-1]:]  # silu(g) * u: |g| |u| bounds it
    eps_out = torch.finfo(y.dtype).eps
    allowed = (eps_out * truth.abs() + 2 * x.shape[1] * 2 ** -24 * scale + 1e-6).max().item() * 2
    error = (y.double() - truth).abs().max().item()
    return error, allowed


def timed(fn) -> float:
    """GPU time of one call replayed from a CUDA graph (no host in it; L2 flushed before each replay), as the
    engine's decode step runs it; do_bench in the interpreter."""
    return (time_graph(fn) if runtime.on_gpu() else time_fn(fn)).median_us


def run_case(name, n, k, m, swiglu, dtype, smoke, out):
    g = torch.Generator(device=runtime.device()).manual_seed(0)
    x = torch.randn(m, k, generator=g, device=runtime.device(), dtype=dtype)
    w = torch.randn(n, k, generator=g, device=runtime.device(), dtype=dtype) / k ** 0.5
    truth = reference(x, w, swiglu)
    nbytes = n * k * w.element_size()
    if swiglu:
        peer = lambda: ops.swiglu(*F.linear(x, w).chunk(2, dim=-1))  # noqa: E731
    else:
        peer = lambda: F.linear(x, w)  # noqa: E731
    t_peer = timed(peer)
    rows = [{"impl": "cuBLAS" + (" + ops.swiglu" if swiglu else ""), "us": t_peer, "gbs": nbytes / t_peer / 1e3}]
    for config in configs(m, swiglu)[: 2 if smoke else None]:
        try:
            y = decode_linear(x, w, config, swiglu)
        except triton.runtime.errors.OutOfResources as e:  # too much shared memory for this GPU: next
            rows.append({"impl": f"triton {config}", "failed": str(e)[:200]})
            continue
        error, allowed = check(y, truth, x, w)
        if not error <= allowed:
            rows.append({"impl": f"triton {config}", "error": error, "allowed": allowed, "failed": True})
            print(f"  {name} M={m} {config}: WRONG error {error:.3g} > {allowed:.3g}", flush=True)
            continue
        t = timed(lambda: decode_linear(x, w, config, swiglu))
        rows.append({"impl": f"triton {config}", "us": t, "gbs": nbytes / t / 1e3, "error": error, "allowed": allowed})
    best = min((r for r in rows[1:] if "us" in r), key=lambda r: r["us"], default=None)
    print(f"{name}{' +swiglu' if swiglu else ''} N={n} K={k} M={m}: cuBLAS {t_peer:.1f} us "
          f"({rows[0]['gbs']:.0f} GB/s); best triton {best and best['impl']} "
          f"{best and round(best['us'], 1)} us ({best and round(best['gbs'])} GB/s)", flush=True)
    out.append({"shape": name, "n": n, "k": k, "m": m, "swiglu": swiglu, "rows": rows})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    smoke = args.smoke or not runtime.on_gpu()
    dtype = torch.bfloat16 if runtime.on_gpu() else torch.float32
    warm_up_gpu()
    out = []
    shapes = {"tiny": (48, 64)} if smoke else SHAPES
    for m in ((1, 3) if smoke else (1, 32)):
        for name, (n, k) in shapes.items():
            run_case(name, n, k, m, False, dtype, smoke, out)
            if name in ("gate_up", "tiny"):
                run_case(name, n, k, m, True, dtype, smoke, out)
    meta = {"gpu": torch.cuda.get_device_name() if runtime.on_gpu() else "cpu", "torch": torch.__version__, "triton": triton.__version__}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "cases": out}, indent=1))


if __name__ == "__main__":
    main()
