"""Experiment (issue 27): FlashAttention's backward at the headline shape, B2 H32 N4096 D128 bf16, full and causal,
against cuDNN's in the same process, two ways:

* lessonlib's two kernels (``ops.flash_attention.backward``: one per key/value tile for dK and dV, one per query
  tile for dQ, no atomics), at its default tiles and at larger ones (a sweep of BLOCK_M, BLOCK_N, warps, stages;
  the dQ kernel takes the dK/dV kernel's tiles the other way round, as ``backward_config`` does);
* one kernel per key/value tile that also adds each tile's share of dQ into a float32 buffer with atomics (FA2's
  original schedule): Q, dO and the scores are loaded and recomputed once instead of twice, at the price of
  ``BLOCK_M x D`` float32 atomic adds per step and a conversion of dQ at the end (both timed).

    python benchmarks/experiments/flash_attention_backward.py --out benchmarks/experiments/results/flash-attention-backward-h200.json

Each variant is checked first against a float32 reference (SDPA on float32 copies of the same inputs): its largest
error on dQ, dK and dV must be within twice lessonlib's default kernels' own (the atomics change only the order of
float32 sums; a wrong kernel is off by far more). Timing: ``triton.testing.do_bench``, median, after 2 s of matrix
products to bring the clocks up; TFLOP/s counts the backward's 2.5x the forward's FLOPs (halved when causal), as
bench_flash_attention.py does. On CPU (the interpreter) it runs one tiny case, checks only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lessonlib import runtime  # noqa: E402

runtime.mode()  # before triton.language is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lessonlib.ops._flash_attention_forward import LOG2E  # noqa: E402
from lessonlib.results import environment  # noqa: E402

fa = importlib.import_module("lessonlib.ops.flash_attention")  # the module (lessonlib.ops.flash_attention is the op)

SWEEP = ((32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3))
ATOMIC = ((32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (16, 128, 4, 3))


@triton.jit
def dkdv_atomic_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    heads, kv_heads, n_q, n_kv, sm_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """lessonlib's dK/dV kernel, plus each step's dQ share, ds^T k, added into the float32 dq (contiguous)."""
    start_n = tl.program_id(0) * BLOCK_N
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < n_kv
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    causal_offset = n_kv - n_q
    lo = 0
    if CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
    q_tile = tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    do_tile = tl.arange(0, BLOCK_M)[:, None] * stride_dom + offs_d[None, :]
    dq_tile = tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + offs_d[None, :]
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_base = q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
        do_base = do_ptr + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
        row_base = (batch * heads + head).to(tl.int64) * n_q
        dq_base = dq_ptr + row_base * HEAD_DIM
        offs_m = lo + tl.arange(0, BLOCK_M)
        for start_m in range(lo, n_q, BLOCK_M):
            m_ok = offs_m < n_q
            q = tl.load(q_base + tl.cast(start_m, tl.int64) * stride_qm + q_tile, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_base + tl.cast(start_m, tl.int64) * stride_dom + do_tile, mask=m_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + row_base + offs_m, mask=m_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + row_base + offs_m, mask=m_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q)) * qk_scale
            visible = n_ok[:, None] & m_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
            p_t = tl.where(visible, tl.math.exp2(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
            dk += tl.dot(ds_t, q)
            dq = tl.dot(tl.trans(ds_t), k) * sm_scale  # (BLOCK_M, HEAD_DIM): this key tile's share
            tl.atomic_add(dq_base + tl.cast(start_m, tl.int64) * HEAD_DIM + dq_tile, dq, mask=m_ok[:, None],
                          sem="relaxed")
            offs_m += BLOCK_M
    dk *= sm_scale
    out_offsets = (batch * kv_heads + kv_head).to(tl.int64) * n_kv * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dk_ptr + out_offsets, dk.to(dk_ptr.dtype.element_ty), mask=n_ok[:, None])
    tl.store(dv_ptr + out_offsets, dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None])


def atomic_backward(q, k, v, out, lse, grad_out, causal, sm_scale, tiles):
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_kv = k.shape[1], k.shape[2]
    delta = (grad_out.float() * out.float()).sum(-1)
    dq = torch.zeros(batch, heads, n_q, head_dim, dtype=torch.float32, device=q.device)
    dk = torch.empty(batch, kv_heads, n_kv, head_dim, dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2))
    dkdv_atomic_dq_kernel[(triton.cdiv(n_kv, tiles["BLOCK_N"]), batch * kv_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, dq, *strides, heads, kv_heads, n_q, n_kv, sm_scale,
        GROUP=heads // kv_heads, CAUSAL=causal, HEAD_DIM=head_dim, **tiles)
    return dq.to(q.dtype), dk, dv


def rung(block_m, block_n, warps, stages):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    gpu = runtime.on_gpu()
    B, H, N, D = (2, 32, 4096, 128) if gpu else (1, 2, 80, 32)
    dtype, dev = runtime.dtype(), runtime.device()
    sweep, atomic = (SWEEP, ATOMIC) if gpu else (((16, 16, 1, 1),), ((16, 16, 1, 1), (16, 32, 1, 1)))
    rows = []
    if gpu:
        from triton.testing import do_bench
        a = torch.randn(4096, 4096, device=dev, dtype=dtype)
        t0 = time.time()
        while time.time() - t0 < 2:
            a @ a
    for causal in (False, True):
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=torch.float32).to(dtype) for _ in range(4))
        scale = D ** -0.5
        ref = [t.float().requires_grad_() for t in (q, k, v)]
        ref_out = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=causal)
        want = torch.autograd.grad(ref_out, ref, do.float())
        del ref, ref_out
        out, lse = fa._forward(q, k, v, causal, scale)
        flops = 2.5 * 4 * B * H * N * N * D * (0.5 if causal else 1.0)

        def error(grads):
            return max((g.float() - w).abs().max().item() for g, w in zip(grads, want))

        variants = {"lessonlib, two kernels, default tiles": lambda: fa.backward(q, k, v, out, lse, do, causal, scale)}
        for r in sweep:
            c = rung(*r)
            variants[f"two kernels, dkdv {r}"] = lambda c=c: fa.backward(
                q, k, v, out, lse, do, causal, scale, {"dkdv": c, "dq": dict(c, BLOCK_M=c["BLOCK_N"], BLOCK_N=c["BLOCK_M"])})
        for r in atomic:
            variants[f"one kernel, atomic dQ {r}"] = lambda c=rung(*r): atomic_backward(q, k, v, out, lse, do, causal,
                                                                                      scale, c)
        base_error = error(variants["lessonlib, two kernels, default tiles"]())
        if gpu:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for name, backend in (("cuDNN (SDPA)", SDPBackend.CUDNN_ATTENTION), ("FA2 (SDPA flash)", SDPBackend.FLASH_ATTENTION)):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                with sdpa_kernel([backend]):
                    o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
                ms = do_bench(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True), return_mode="median")
                rows.append({"causal": causal, "variant": name, "ms": round(ms, 4),
                             "tflops": round(flops / ms / 1e9, 1), "max_error": round(error(torch.autograd.grad(o, leaves, do, retain_graph=True)), 5)})
                print(f"causal={causal} {name:40s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
        for name, fn in variants.items():
            try:
                err = error(fn())
                ok = err <= 2 * base_error
                ms = do_bench(fn, return_mode="median") if gpu and ok else None
            except Exception as e:  # a configuration that does not compile or fit is recorded
                rows.append({"causal": causal, "variant": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"causal={causal} {name:40s} {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            rows.append({"causal": causal, "variant": name, "max_error": round(err, 5), "passed": ok,
                         "ms": None if ms is None else round(ms, 4),
                         "tflops": None if ms is None else round(flops / ms / 1e9, 1)})
            print(f"causal={causal} {name:40s} err {err:.4f} (allowed {2 * base_error:.4f}) "
                  + (f"{ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s" if ms else ""), flush=True)
            if not ok:
                raise SystemExit(f"{name}: error {err} past twice the default kernels' {base_error}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python benchmarks/experiments/flash_attention_backward.py", "environment": environment(),
            "shape": {"B": B, "H": H, "N": N, "D": D, "dtype": str(dtype)}, "tiles": "(BLOCK_M, BLOCK_N, num_warps, "
            "num_stages) of the dK/dV (or one) kernel; BLOCK_N is the key tile it keeps", "results": rows}, indent=1))


if __name__ == "__main__":
    main()
