"""Experiment (not a recorded benchmark): which tiles for ops.decode_gemv, and what the fused batch-1 layer gives.

    python -m benchmarks.experiments.decode_gemv_tiles [--smoke] [--out FILE]

Times the projections of a batch-1 decode step without attention, every layer with its own weights (nothing stays
in the L2), captured in one CUDA graph and replayed (lessonlib.measure.time_graph), on the Llama-3.2-1B and
Qwen2.5-0.5B shapes:

- today's chain: add_rms_norm, gemv (qkv), rope_store_kv, gemv (o), add_rms_norm, gemv (gate_up + SwiGLU),
  gemv (down): 7 kernels per layer;
- the fused chain (Features.fused_decode_layer): decode_qkv_rope_store_kv, decode_gemv (o + residual), decode_gemv
  (norm + gate_up + SwiGLU), decode_gemv (down + residual): 4 kernels per layer, at each tile candidate below
  (``decode_gemv.config`` replaced for the run: BLOCK_N, BLOCK_K, num_warps of one epilogue's kernels at a time,
  the others at ``decode_gemv.GPU_TILES``);

beside the weights' read time at the copy bandwidth measured in the same run. The winners go into
``decode_gemv.GPU_TILES``. Correctness is the op tests' job (tests/ops/test_decode_gemv.py, every tile shape in the
interpreter; on the GPU at the engine's tiles). ``--smoke`` runs each chain once at tiny sizes, in any mode.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path


import torch

from lessonlib import ops, reference, runtime
from lessonlib.measure import measure_ceilings, time_graph, warm_up_gpu
from lessonlib.ops._common import next_power_of_2

decode_gemv = importlib.import_module("lessonlib.ops.decode_gemv")
SHAPES = {  # hidden, intermediate, layers, heads, kv heads, head_dim
    "Llama-3.2-1B": (2048, 8192, 16, 32, 8, 64),
    "Qwen2.5-0.5B": (896, 4864, 24, 14, 2, 64),
    "smoke": (64, 96, 2, 4, 2, 16),
}
# Each epilogue's best candidate of the H200 sweep of 2026-12-03 (session 15), tried one at a time; timed here
# together, interleaved with GPU_TILES rows (their spread is the run's noise), before they become the defaults.
TOGETHER = {decode_gemv.ROPE_KV: (4, 2048, 4), decode_gemv.SWIGLU: (4, 2048, 4)}
CANDIDATES = {  # (BLOCK_N, BLOCK_K, num_warps) per epilogue, tried one epilogue at a time, the others at GPU_TILES
    decode_gemv.RESIDUAL: [(4, 2048, 4), (8, 1024, 4), (2, 4096, 4), (4, 2048, 8), (8, 2048, 8)],  # o, down
    decode_gemv.SWIGLU: [(8, 1024, 4), (4, 2048, 4), (4, 1024, 4), (16, 512, 4), (8, 1024, 8)],  # gate_up
    decode_gemv.ROPE_KV: [(2, 2048, 4), (4, 2048, 4), (8, 1024, 4), (2, 1024, 4), (4, 1024, 8)],  # qkv
}


def layers_for(shape, dtype):
    h, inter, n_layers, heads, kv_heads, d = shape
    device = runtime.device()

    def w(n, k):
        return (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)

    return [{"qkv": w((heads + 2 * kv_heads) * d, h), "qkv_bias": w(1, (heads + 2 * kv_heads) * d)[0],
             "o": w(h, heads * d), "gate_up": w(2 * inter, h), "down": w(h, inter),
             "norm1": torch.ones(h, device=device, dtype=dtype), "norm2": torch.ones(h, device=device, dtype=dtype)}
            for _ in range(n_layers)]


def chains(shape, dtype):
    """(today, fused): each a function running every layer's projections on one token."""
    h, _, _, heads, kv_heads, d = shape
    device = runtime.device()
    layers = layers_for(shape, dtype)
    k_cache = torch.zeros(4, 16, kv_heads, d, device=device, dtype=dtype)
    v_cache, slots = torch.zeros_like(k_cache), torch.tensor([5], device=device)
    cos, sin = reference.rope_cos_sin(torch.tensor([37], device=device), d, dtype=dtype)
    stream, eps = torch.randn(1, h, device=device, dtype=dtype), 1e-5
    attn = torch.randn(1, heads * d, device=device, dtype=dtype)  # stands for attention's output
    heads_kw = {"num_heads": heads, "num_kv_heads": kv_heads}

    def today():
        hidden, residual = stream, torch.zeros_like(stream)
        for w in layers:
            normed, residual = ops.add_rms_norm(hidden, residual, w["norm1"], eps)
            qkv = ops.gemv(normed, w["qkv"], w["qkv_bias"])
            ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, validate=False, **heads_kw)
            hidden = ops.gemv(attn, w["o"])
            normed, residual = ops.add_rms_norm(hidden, residual, w["norm2"], eps)
            hidden = ops.gemv(ops.gemv(normed, w["gate_up"], activation="swiglu"), w["down"])
        return hidden

    def fused():
        x = stream.clone()
        for w in layers:
            ops.decode_qkv_rope_store_kv(x, w["qkv"], w["qkv_bias"], w["norm1"], cos, sin, k_cache, v_cache, slots,
                                         eps=eps, validate=False, **heads_kw)  # no host sync in the graph
            ops.decode_gemv(attn, w["o"], residual=x)
            act = ops.decode_gemv(x, w["gate_up"], norm_weight=w["norm2"], eps=eps, activation="swiglu")
            ops.decode_gemv(act, w["down"], residual=x)
        return x

    weight_bytes = sum(t.numel() * t.element_size() for w in layers for t in w.values())
    return today, fused, weight_bytes


def with_tiles(epilogue, tiles):
    """decode_gemv.config with ``tiles`` for one epilogue, GPU_TILES for the others."""
    return with_table({**decode_gemv.GPU_TILES, epilogue: tiles})


def with_table(table):
    """decode_gemv.config with ``table`` ({epilogue: (BLOCK_N, BLOCK_K, num_warps)}) in place of GPU_TILES."""

    def config(n_out, k, which):
        block_n, block_k, warps = table[which]
        return {"BLOCK_N": block_n, "BLOCK_K": min(block_k, next_power_of_2(k)), "num_warps": warps}
    return config


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    dtype = runtime.dtype(cpu=torch.float32)
    if args.smoke or not runtime.on_gpu():
        today, fused, _ = chains(SHAPES["smoke"], dtype)
        with torch.inference_mode():
            print("smoke: today", today().shape, "fused", fused().shape)
        return
    warm_up_gpu()
    bandwidth = measure_ceilings().bandwidth_gbs * 1e9
    results, default = [], decode_gemv.config
    for name in ("Llama-3.2-1B", "Qwen2.5-0.5B"):
        today, fused, weight_bytes = chains(SHAPES[name], dtype)
        limit_us = weight_bytes / bandwidth * 1e6
        with torch.inference_mode():
            rows = [("today (7 kernels per layer)", None, time_graph(today).median_us)]
            for epilogue, candidates in CANDIDATES.items():
                for tiles in candidates:
                    decode_gemv.config = with_tiles(epilogue, tiles)
                    label = {decode_gemv.RESIDUAL: "o/down", decode_gemv.SWIGLU: "gate_up", decode_gemv.ROPE_KV: "qkv"}
                    rows.append(("fused (4 kernels per layer)", f"{label[epilogue]} {tiles}",
                                 time_graph(fused).median_us))
            for round_ in range(3):  # the winners together, each round beside a GPU_TILES row
                decode_gemv.config = default
                rows.append(("fused (4 kernels per layer)", f"GPU_TILES, round {round_ + 1}",
                             time_graph(fused).median_us))
                decode_gemv.config = with_table({**decode_gemv.GPU_TILES, **TOGETHER})
                rows.append(("fused (4 kernels per layer)", f"qkv and gate_up together, round {round_ + 1}",
                             time_graph(fused).median_us))
            decode_gemv.config = default
        for label, tiles, us in rows:
            print(f"{name:14s} {label:30s} tiles {tiles}: {us:8.1f} us, weight-read limit {limit_us:6.1f} us "
                  f"({limit_us / us:.2f}x)", flush=True)
            results.append({"shape": name, "chain": label, "tiles": tiles, "us": us, "limit_us": limit_us})
    if args.out:
        Path(args.out).write_text(json.dumps({"bandwidth_gbs": bandwidth / 1e9, "results": results}, indent=1))


if __name__ == "__main__":
    main()
