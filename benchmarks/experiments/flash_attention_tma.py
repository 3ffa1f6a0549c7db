"""Experiment, not part of the course (issue 3): FlashAttention forward with TMA tensor descriptors and Triton's warp
specialization, non-causal B2 H32 N4096 D128, against lessonlib's kernel and SDPA cuDNN in the same process.

    python benchmarks/experiments/flash_attention_tma.py     (on a GPU; on CPU it checks one tiny case)
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

from lessonlib import runtime  # noqa: E402

runtime.mode()  # before triton.language is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


@triton.jit
def fwd_tma(desc_q, desc_k, desc_v, desc_o, n_ctx, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, WS: tl.constexpr):
    start_m = tl.program_id(0)
    offset_y = tl.program_id(1) * n_ctx
    qo_offset = offset_y + start_m * BLOCK_M
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q = desc_q.load([qo_offset, 0])
    for start_n in tl.range(0, n_ctx, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([offset_y + start_n, 0]).T
        qk = tl.dot(q, k)
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([offset_y + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_ij
    desc_o.store([qo_offset, 0], (acc / l_i[:, None]).to(desc_o.dtype))


def run(q, k, v, bm, bn, warps, stages, ws):
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    flat = lambda t: t.reshape(B * H * N, D)
    dq = TensorDescriptor(flat(q), shape=[B * H * N, D], strides=[D, 1], block_shape=[bm, D])
    dk = TensorDescriptor(flat(k), shape=[B * H * N, D], strides=[D, 1], block_shape=[bn, D])
    dv = TensorDescriptor(flat(v), shape=[B * H * N, D], strides=[D, 1], block_shape=[bn, D])
    do = TensorDescriptor(flat(o), shape=[B * H * N, D], strides=[D, 1], block_shape=[bm, D])
    fwd_tma[(N // bm, B * H)](dq, dk, dv, do, N, D ** -0.5 * 1.4426950408889634, BLOCK_M=bm, BLOCK_N=bn,
                              HEAD_DIM=D, WS=ws, num_warps=warps, num_stages=stages)
    return o


def main():
    gpu = runtime.on_gpu()
    B, H, N, D = (2, 32, 4096, 128) if gpu else (1, 2, 128, 32)
    dtype = runtime.dtype()  # bfloat16 where the GPU has it, float16 on a T4 and in the interpreter
    dev = runtime.device()
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=torch.float32).to(dtype) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    flops = 4 * B * H * N * N * D
    configs = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)] if gpu else [(32, 32, 1, 1)]
    if gpu:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from lessonlib import ops
        from triton.testing import do_bench
        a = torch.randn(4096, 4096, device="cuda", dtype=dtype)
        t0 = time.time()
        while time.time() - t0 < 2: a @ a
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), return_mode="median")
        print(f"cuDNN {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        ms = do_bench(lambda: ops.flash_attention(q, k, v), return_mode="median")
        print(f"lessonlib {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    for ws in (False, True):
        for bm, bn, w, st in configs:
            label = f"TMA BLOCK_M={bm} BLOCK_N={bn} warps={w} stages={st} warp_specialize={ws}"
            try:
                out = run(q, k, v, bm, bn, w, st, ws)
                err = (out.float() - want).abs().max().item()
                ms = do_bench(lambda: run(q, k, v, bm, bn, w, st, ws), return_mode="median") if gpu else float("nan")
                print(f"{label}: max err {err:.3g}, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as e:
                print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)


if __name__ == "__main__":
    main()
