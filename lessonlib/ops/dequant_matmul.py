"""dequant_matmul: ``x @ (weight_int8 * scales[:, None]).T`` with the int8 weight dequantised in registers.

Weight-only quantisation, the common decode case: the (N, K) weight is stored as int8, one float scale per output
row (per output channel), activations stay 16-bit. At decode a linear layer's time is its weight read (see
:mod:`lessonlib.ops.gemv`), so one byte per weight instead of two halves the bytes, if nothing reads 16 bits again.
Eager PyTorch does: ``weight_int8.to(dtype)`` (reads N K bytes, writes 2 N K), ``* scales[:, None]`` (reads and
writes 2 N K), then the GEMM (reads 2 N K): 9 N K bytes of weight traffic against the 2 N K of a plain 16-bit layer.
The fused kernel reads each int8 tile once, converts it to x's dtype in registers (exact: every int8 is a float16),
feeds ``tl.dot`` and applies the scales once per output column at the end, since
``sum_k x_mk (w_nk s_n) = s_n sum_k x_mk w_nk``: N K bytes of weight.

Each program owns a (BLOCK_M, BLOCK_N) tile of the output and walks K in BLOCK_K steps; accumulation in float32
(``input_precision="ieee"`` for float32 inputs: no TF32 rounding), rounded once on the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib import runtime
from lessonlib.ops._common import check_tensors, launch, next_power_of_2, refuse_gradient


@triton.jit
def _dequant_matmul_kernel(
    x_ptr,  # (M, K), rows stride_xm apart, columns contiguous
    w_ptr,  # (N, K) int8, rows stride_wn apart, columns contiguous
    scales_ptr,  # (N,) in x's dtype, contiguous
    out_ptr,  # (M, N) contiguous
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,  # rows of x per program
    BLOCK_N: tl.constexpr,  # output columns (weight rows) per program
    BLOCK_K: tl.constexpr,  # the K step
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding), else the default
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_tile = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]  # (BLOCK_M, BLOCK_K)
    w_tile = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]  # (BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_tile + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile + k0, mask=col_ok[:, None] & k_ok[None, :], other=0)
        # int8 -> float16/bfloat16/float32: exact, in registers; 16 bits never reach memory
        w = w.to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
    scales = tl.load(scales_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    # the per-output-channel scale, once per output instead of once per weight
    out = acc * scales[None, :]
    out_tile = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out_tile, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def config(m: int, n: int, k: int) -> dict:
    """Tiles. On a GPU, not swept (starting points: benchmarks/bench_fusion_extras.py records what they give): at
    decode (M <= 16) the smallest tile tl.dot takes along M and many programs along N, so that the weight read is
    spread over every SM; at prefill square-ish tiles that reuse each weight tile for 64 rows. Shared memory at 3
    stages: (BLOCK_M x BLOCK_K x 2 + BLOCK_N x BLOCK_K) bytes each, 36-48 KB, under a T4's 64 KB. In the
    interpreter, where each program costs milliseconds of Python, as few programs as the arrays allow (at least 16
    along each axis, tl.dot's smallest tile on a GPU)."""
    if runtime.gpu_profile() is not None:
        if m <= 16:
            return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)
    def clamp(size: int) -> int:
        return max(16, min(next_power_of_2(size), 64))
    return dict(BLOCK_M=clamp(m), BLOCK_N=clamp(n), BLOCK_K=clamp(k), num_warps=4)


def _check(x, weight_int8, scales) -> None:
    check_tensors("dequant_matmul", x=x, scales=scales)
    if not isinstance(weight_int8, torch.Tensor):
        raise TypeError(f"dequant_matmul: weight_int8 must be a torch.Tensor, got {type(weight_int8).__name__}")
    if weight_int8.dtype != torch.int8:
        raise TypeError(f"dequant_matmul: weight_int8 must be torch.int8, got {weight_int8.dtype}")
    if weight_int8.device != x.device:
        raise ValueError(f"dequant_matmul: tensors on different devices: x on {x.device}, weight_int8 on "
                         f"{weight_int8.device}")
    if x.dim() != 2 or weight_int8.dim() != 2:
        raise ValueError(f"dequant_matmul: x must be (M, K) and weight_int8 (N, K), got {tuple(x.shape)} and "
                         f"{tuple(weight_int8.shape)}")
    if x.shape[1] != weight_int8.shape[1]:
        raise ValueError(f"dequant_matmul: x has K={x.shape[1]} columns but weight_int8 has K={weight_int8.shape[1]}")
    if weight_int8.shape[1] > 1 and weight_int8.stride(1) != 1:
        raise ValueError("dequant_matmul: weight_int8 must be contiguous in its last dimension; call .contiguous()")
    if tuple(scales.shape) != (weight_int8.shape[0],):
        raise ValueError(f"dequant_matmul: scales must be (N,) = ({weight_int8.shape[0]},), one per output row, got "
                         f"{tuple(scales.shape)}")


def dequant_matmul(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight_int8.to(x.dtype) * scales[:, None]).T``, fused (``lessonlib.reference.dequant_matmul``'s twin).

    x: (M, K) float16, float32 or bfloat16 (where supported), last dimension contiguous; weight_int8: (N, K) int8 as
    ``nn.Linear`` stores its weight; scales: (N,) in x's dtype. Returns (M, N) in x's dtype. No backward."""
    refuse_gradient("dequant_matmul", "it has no backward: an inference kernel", x=x, scales=scales)
    _check(x, weight_int8, scales)
    (m, k), n = x.shape, weight_int8.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.numel() == 0 or k == 0:
        return out.zero_()
    meta = config(m, n, k)
    launch(_dequant_matmul_kernel, (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])),
           x, weight_int8, scales, out, m, n, k, x.stride(0), weight_int8.stride(0),
           INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **meta)
    return out
