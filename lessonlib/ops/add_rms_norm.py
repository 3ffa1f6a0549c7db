"""add_rms_norm: residual add + RMSNorm in one kernel, returning both outputs.

A pre-norm block does ``residual = x + residual; h = rms_norm(residual) * weight``. Eager PyTorch runs about
seven kernels for that, several with float32 temporaries. The fused kernel reads x, residual and weight once and
writes the normalized output and the updated residual once: 4 passes over a (T, H) tensor, the minimum.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lessonlib import runtime
from lessonlib.ops._common import check_tensors, launch, next_power_of_2, num_warps_for

# Rows up to this many elements stay in registers (one read, one write). Wider rows take two passes over the
# updated residual: 16384 fp32 values is 32 per thread at 16 warps, beyond that the kernel would spill.
MAX_ONE_PASS_COLS = 16384
TWO_PASS_BLOCK = 4096
# Programs per multiprocessor when a GPU has more rows than that: a placeholder until the sweep in
# benchmarks/bench_fusion.py decides.
PROGRAMS_PER_SM = 8


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # (n_rows, n_cols), rows x_row_stride apart
    residual_ptr,  # (n_rows, n_cols), rows residual_row_stride apart
    weight_ptr,  # (n_cols,)
    out_ptr,  # (n_rows, n_cols) contiguous: weight * rms_norm(x + residual)
    residual_out_ptr,  # (n_rows, n_cols) contiguous: x + residual, the next layer's residual stream
    n_rows,
    n_cols,
    x_row_stride,
    residual_row_stride,
    eps,
    BLOCK: tl.constexpr,  # columns handled at a time; the whole row when ONE_PASS
    ONE_PASS: tl.constexpr,  # n_cols <= BLOCK: keep the row in registers
):
    # Each program walks rows pid, pid + n_programs, ... so the grid can be sized to the GPU rather than to the
    # number of rows, and the weight is loaded once per program instead of once per row.
    dtype = out_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31
    step = tl.num_programs(0).to(tl.int64)
    x_ptr += pid * x_row_stride
    residual_ptr += pid * residual_row_stride
    out_ptr += pid * n_cols
    residual_out_ptr += pid * n_cols
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
        for _ in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(residual_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            # Round the sum to the input dtype first: that *is* the residual stream, and the statistic is taken
            # over it, exactly as the reference does.
            h = (x + r).to(dtype)
            tl.store(residual_out_ptr + cols, h, mask=mask)
            h = h.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
            out = (h * rstd).to(dtype).to(tl.float32) * w
            tl.store(out_ptr + cols, out.to(dtype), mask=mask)
            x_ptr += step * x_row_stride
            residual_ptr += step * residual_row_stride
            out_ptr += step * n_cols
            residual_out_ptr += step * n_cols
    else:
        for _ in range(tl.program_id(0), n_rows, tl.num_programs(0)):
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
            x_ptr += step * x_row_stride
            residual_ptr += step * residual_row_stride
            out_ptr += step * n_cols
            residual_out_ptr += step * n_cols


def programs_for(n_rows: int) -> int:
    """Grid size: one program per row, capped at PROGRAMS_PER_SM per multiprocessor on a GPU. In the interpreter
    fewer programs also means fewer (slow) Python-level program runs."""
    if runtime.on_gpu():
        return min(n_rows, PROGRAMS_PER_SM * _multiprocessors())
    return min(n_rows, 4)


@functools.lru_cache(maxsize=None)
def _multiprocessors() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


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
    if x.numel() == 0:
        return out, residual_out
    x2d, residual2d = x.reshape(-1, n_cols), residual.reshape(-1, n_cols)
    one_pass = n_cols <= MAX_ONE_PASS_COLS
    block = next_power_of_2(n_cols) if one_pass else TWO_PASS_BLOCK
    n_rows = x2d.shape[0]
    launch(
        _add_rms_norm_kernel, (programs_for(n_rows),),
        x2d, residual2d, weight, out, residual_out, n_rows, n_cols, x2d.stride(0), residual2d.stride(0), float(eps),
        BLOCK=block, ONE_PASS=one_pass, num_warps=num_warps_for(block),
    )
    return out, residual_out
