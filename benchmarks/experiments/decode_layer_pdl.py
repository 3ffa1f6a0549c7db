"""Experiment (not a recorded benchmark): does programmatic dependent launch (PDL) shorten a batch-1 decode step?

    python -m benchmarks.experiments.decode_layer_pdl [--smoke] [--out FILE]

Session 7 found that at batch 1 each weight read (a GEMV, M = 1) pays a fixed ~7-8 us on the H200 that no tile choice
removed: the next kernel starts only when the previous one has finished and its memory is flushed, and its first
weight bytes arrive a DRAM latency later. With PDL (Hopper: ``griddepcontrol``) a kernel launched with
``launch_pdl=True`` may start while the previous kernel is still running; it loads its weights (which do not depend
on the previous kernel) and only then waits (``gdc_wait``) for the activations. This times the weight reads of the
engine's 16-layer Llama-3.2-1B decode step as one chain (x -> qkv -> o -> gate_up with SwiGLU -> down, per layer,
each layer's own weights, 1.94 GB: nothing stays in the L2), captured in one CUDA graph and replayed:

- cuBLAS (``F.linear``) + ``ops.swiglu``, as the engine runs today;
- a Triton GEMV (SwiGLU in gate_up's epilogue), no PDL;
- the same GEMV with PDL: first weight tile loaded, then ``gdc_wait``; dependents triggered after the wait
  ("late") or at the program's start ("early").

Each GEMV configuration is checked against float64 first (the rule of ``decode_linear.py``). Prints one line per
result and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


import torch
import torch.nn.functional as F

from lessonlib import ops, runtime  #  (before triton: it chooses the interpreter on a CPU)
from lessonlib.measure import time_graph, warm_up_gpu

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL variants are skipped
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SWIGLU: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """y = x @ W.T for one row x (K,), W (N, K); program n: columns [n*BLOCK_N, (n+1)*BLOCK_N). SWIGLU: W holds gate
    rows then up rows; y = silu(gate) * up, (N/2,). PDL: the first K tile of W is loaded before waiting for the
    previous kernel (x is its output)."""
    pid = tl.program_id(0)
    n_out = N // 2 if SWIGLU else N
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    ok = cols[:, None] < n_out
    w_rows = w_ptr + cols[:, None] * K + ks[None, :]
    w = tl.load(w_rows, mask=ok, other=0.0)
    if SWIGLU:
        wu = tl.load(w_rows + n_out * K, mask=ok, other=0.0)
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
        if not EARLY:
            gdc_launch_dependents()
    x = tl.load(x_ptr + ks).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if SWIGLU:
        acc_up = tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + ks).to(tl.float32)
        w = tl.load(w_rows + k0, mask=ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if SWIGLU:
            wu = tl.load(w_rows + n_out * K + k0, mask=ok, other=0.0)
            acc_up += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    tl.store(y_ptr + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < n_out)


def gemv(x, w, config, swiglu=False, pdl=None):
    """x (K,), w (N, K) contiguous; config (BLOCK_N, BLOCK_K, warps); pdl None, "late" or "early"."""
    n, k = w.shape
    n_out = n // 2 if swiglu else n
    bn, bk, warps = config
    y = torch.empty(n_out, dtype=x.dtype, device=x.device)
    extra = {"launch_pdl": True} if pdl else {}
    _gemv_kernel[(triton.cdiv(n_out, bn),)](x, w, y, n, K=k, BLOCK_N=bn, BLOCK_K=bk, SWIGLU=swiglu, PDL=bool(pdl),
                                            EARLY=pdl == "early", num_warps=warps, **extra)
    return y


SHAPES = {"qkv": (3072, 2048, False), "o": (2048, 2048, False), "gate_up": (16384, 2048, True),
          "down": (2048, 8192, False)}
CONFIGS = [(4, 2048, 4), (8, 2048, 8), (16, 2048, 8), (16, 512, 4), (8, 1024, 4), (32, 256, 4)]


def check(y, x, w, swiglu):
    """Error allowed: bf16 rounding of the output plus K float32 accumulation roundings of |x||w| products."""
    truth = w.double() @ x.double()
    scale = w.double().abs() @ x.double().abs()
    if swiglu:
        g, u = truth.chunk(2)
        truth = F.silu(g) * u
        sg, su = scale.chunk(2)
        scale = sg * su
    allowed = (torch.finfo(y.dtype).eps * truth.abs() + 2 * x.shape[0] * 2 ** -24 * scale + 1e-6).max().item() * 2
    error = (y.double() - truth).abs().max().item()
    return error, allowed


def replay_us(graph, reps=50) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dev, dtype = runtime.device(), torch.bfloat16 if runtime.on_gpu() else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name() if runtime.on_gpu() else "cpu", "torch": torch.__version__,
               "triton": triton.__version__, "single": [], "chain": []}
    pdl_modes = [None] + (["late", "early"] if runtime.on_gpu() and gdc_wait is not None else [])
    best = {name: pick_tiles(name, shape, pdl_modes, args.smoke, g, dtype, results)
            for name, shape in SHAPES.items()}
    if not runtime.on_gpu():
        print("checks passed (no timing off a GPU)")
        return
    time_chains(args.layers, {(name, p): c for name, by_mode in best.items() for p, c in by_mode.items()},
                pdl_modes, g, dtype, results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def pick_tiles(name, shape, pdl_modes, smoke, g, dtype, results) -> dict:
    """Check every tile configuration against float64; on a GPU time each (one GEMV replayed from a graph, cold L2)
    and return the best configuration per PDL mode (PDL variants use the best configuration without PDL)."""
    n, k, swiglu = shape
    if smoke:
        n, k = n // 16, k // 16
    dev = runtime.device()
    x = torch.randn(k, generator=g, device=dev, dtype=dtype)
    w = torch.randn(n, k, generator=g, device=dev, dtype=dtype) / k ** 0.5
    timings = []

    def attempt(config, pdl):
        try:
            y = gemv(x, w, config, swiglu, pdl)
        except Exception as e:  # noqa: BLE001  (too many registers, an old Triton): next
            print(f"{name} {config} pdl={pdl}: failed {type(e).__name__}: {str(e)[:120]}")
            return
        error, allowed = check(y, x, w, swiglu)
        if not error <= allowed:
            print(f"{name} {config} pdl={pdl}: WRONG error {error:.3g} > {allowed:.3g}")
            return
        if runtime.on_gpu():
            us = time_graph(lambda: gemv(x, w, config, swiglu, pdl)).median_us
            timings.append((us, config, pdl))
            results["single"].append({"shape": name, "config": config, "pdl": pdl, "us": us,
                                      "gbs": n * k * 2 / us / 1e3})

    for config in CONFIGS:  # tiles chosen without PDL; the PDL variants use the best one
        attempt((config[0], min(config[1], k), config[2]), None)
    if not runtime.on_gpu():
        return {}
    best_config = min(timings)[1]
    for pdl in pdl_modes[1:]:
        attempt(best_config, pdl)
    best = {}
    for pdl in pdl_modes:
        us, config, _ = min(t for t in timings if t[2] == pdl)
        best[pdl] = config
        print(f"{name}: {config} pdl={pdl} {us:.1f} us ({n * k * 2 / us / 1e3:.0f} GB/s)", flush=True)
    peer = (lambda: ops.swiglu(*F.linear(x, w).chunk(2, dim=-1))) if swiglu else (lambda: F.linear(x, w))
    us = time_graph(peer).median_us
    results["single"].append({"shape": name, "config": "cuBLAS", "us": us, "gbs": n * k * 2 / us / 1e3})
    print(f"{name}: cuBLAS {us:.1f} us ({n * k * 2 / us / 1e3:.0f} GB/s)", flush=True)
    return best


def time_chains(num_layers, best, pdl_modes, g, dtype, results):
    """The layers' products as one chain in one CUDA graph, per variant. The relative difference from cuBLAS's
    chain is printed as a sanity check only (random weights: activations drift over 64 products)."""
    dev = runtime.device()
    layers = [{name: torch.randn(n, k, generator=g, device=dev, dtype=dtype) / k ** 0.5
               for name, (n, k, _) in SHAPES.items()} for _ in range(num_layers)]
    nbytes = sum(w.numel() * 2 for layer in layers for w in layer.values())
    x0 = torch.randn(2048, generator=g, device=dev, dtype=dtype)

    def chain_cublas():
        x = x0
        for layer in layers:
            x = F.linear(x, layer["qkv"])[:2048]
            x = F.linear(x, layer["o"])
            x = ops.swiglu(*F.linear(x, layer["gate_up"]).chunk(2, dim=-1))
            x = F.linear(x, layer["down"])
        return x

    def chain_triton(pdl):
        def run():
            x = x0
            for layer in layers:
                x = gemv(x, layer["qkv"], best["qkv", pdl], False, pdl)[:2048]
                x = gemv(x, layer["o"], best["o", pdl], False, pdl)
                x = gemv(x, layer["gate_up"], best["gate_up", pdl], True, pdl)
                x = gemv(x, layer["down"], best["down", pdl], False, pdl)
            return x
        return run

    variants = {"cuBLAS + ops.swiglu": chain_cublas, **{f"triton pdl={p}": chain_triton(p) for p in pdl_modes}}
    truth = chain_cublas()
    for label, fn in variants.items():
        try:
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            graph.replay()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (PDL under stream capture unsupported?): report, go on
            print(f"chain {label}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rel = ((out.float() - truth.float()).norm() / truth.float().norm()).item()
        us = replay_us(graph)
        row = {"impl": label, "layers": num_layers, "us": us, "gbs": nbytes / us / 1e3, "rel_diff_vs_cublas": rel}
        results["chain"].append(row)
        print(f"chain {label}: {us:.0f} us for {nbytes / 1e9:.2f} GB ({row['gbs']:.0f} GB/s), "
              f"rel. diff vs cuBLAS {rel:.2e}", flush=True)


if __name__ == "__main__":
    warm_up_gpu() if runtime.on_gpu() else None
    main()
