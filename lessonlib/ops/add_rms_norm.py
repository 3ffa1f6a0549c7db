"""add_rms_norm: residual add + RMSNorm in one kernel, returning both outputs.

A pre-norm block does ``residual = x + residual; h = rms_norm(residual) * weight``. Eager PyTorch runs about
seven kernels for that, several with float32 temporaries. The fused kernel reads x, residual and weight once and
writes the normalized output and the updated residual once: 4 passes over a (T, H) tensor, the minimum.
"""

from __future__ import annotations

import torch
import triton.language as tl
import triton

from lessonlib.ops._common import check_tensors, launch, next_power_of_2

# Rows up to this many elements stay in registers (one read, one write). Wider rows take two passes over the
# updated residual. Measured on the H200 (bench_fusion.py, register_pressure, 16 warps): one pass uses 58 registers
# per thread at 16384 columns and 127 at 32768 (4,154 GB/s against 3,443 for two passes), and spills 80 registers
# at 65536, where it falls to 1,955 GB/s against 3,311 for two passes.
MAX_ONE_PASS_COLS = 32768
TWO_PASS_BLOCK = 4096
ELEMENTS_PER_WARP = 2048

# One program per row. Tried on the H200 at T=8192, H=4096 bf16: a grid-stride loop with 1 to 32 programs per
# multiprocessor (weight loaded once per program) reached 2,357 to 3,772 GB/s; one program per row, 3,755 to
# 3,830 GB/s. Warps per row: 1 or 2 (128 or 64 columns per thread) 3,843 GB/s, 4: 3,825, 8 and 16: 3,804. So a
# warp takes 2048 columns (64 per thread), up to 16 warps.


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # (n_rows, n_cols), rows x_row_stride apart
    residual_ptr,  # (n_rows, n_cols), rows residual_row_stride apart
    weight_ptr,  # (n_cols,)
    out_ptr,  # (n_rows, n_cols) contiguous: weight * rms_norm(x + residual)
    residual_out_ptr,  # (n_rows, n_cols) contiguous: x + residual, the next layer's residual stream
    n_cols,
    x_row_stride,
    residual_row_stride,
    eps,
    BLOCK: tl.constexpr,  # columns handled at a time; the whole row when ONE_PASS
    ONE_PASS: tl.constexpr,  # n_cols <= BLOCK: keep the row in registers
):
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * x_row_stride
    residual_ptr += row * residual_row_stride
    out_ptr += row * n_cols
    residual_out_ptr += row * n_cols
    dtype = out_ptr.dtype.element_ty

    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(residual_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the input dtype first: that *is* the residual stream, and the statistics are
        # taken over it, exactly as the reference does.
        h = (x + r).to(dtype)
        tl.store(residual_out_ptr + cols, h, mask=mask)
        h = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
        out = (h * rstd).to(dtype).to(tl.float32) * w
        tl.store(out_ptr + cols, out.to(dtype), mask=mask)
    else:
        # Pass 1: write the updated residual, accumulate the sum of squares.
        sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(residual_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(dtype)
            tl.store(residual_out_ptr + cols, h, mask=mask)
            h = h.to(tl.float32)
            sum_sq += h * h
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
        tl.debug_barrier()  # pass 2 reads back what pass 1 stored
        # Pass 2: read the updated residual back (one extra read of the row) and normalize.
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            h = tl.load(residual_out_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
            out = (h * rstd).to(dtype).to(tl.float32) * w
            tl.store(out_ptr + cols, out.to(dtype), mask=mask)


def config(n_cols: int, profile=None) -> dict:
    """BLOCK, ONE_PASS and warps for rows of ``n_cols`` elements.
    The same on every GPU, ``profile`` accepted for a uniform interface: the kernel keeps its elements in registers
    and needs no shared memory beyond the sum of squares across warps (compiled for sm_75 to sm_90: tests/ops/test_compile_targets.py)."""
    if n_cols <= MAX_ONE_PASS_COLS:
        block = next_power_of_2(n_cols)
        return dict(BLOCK=block, ONE_PASS=True, num_warps=min(16, max(1, block // ELEMENTS_PER_WARP)))
    return dict(BLOCK=TWO_PASS_BLOCK, ONE_PASS=False, num_warps=16)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``residual + x`` then RMSNorm; returns ``(normalized, updated_residual)`` like
    ``lessonlib.reference.add_rms_norm``. x, residual: (..., H) of one shape; weight: (H,)."""
    check_tensors("add_rms_norm", x=x, residual=residual, weight=weight)
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x and residual must have the same shape, got {tuple(x.shape)} and {tuple(residual.shape)}")
    if x.dim() == 0:
        raise ValueError("add_rms_norm: expected x of shape (..., H), got a scalar")
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"add_rms_norm: weight must have shape ({n_cols},) to match x's last dimension, got {tuple(weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"add_rms_norm: eps must be >= 0, got {eps}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out, residual_out
    x2d, residual2d = (x, residual) if x.dim() == 2 else (x.reshape(-1, n_cols), residual.reshape(-1, n_cols))
    launch(
        _add_rms_norm_kernel, (x2d.shape[0],),
        x2d, residual2d, weight, out, residual_out, n_cols, x2d.stride(0), residual2d.stride(0), float(eps),
        **config(n_cols),
    )
    return out, residual_out
