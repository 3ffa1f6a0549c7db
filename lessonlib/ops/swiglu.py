"""swiglu: silu(gate) * up in one kernel.

Eager PyTorch runs two kernels: silu reads gate and writes a temporary, mul reads the temporary and up and writes
the output: 5 passes over a (T, I) tensor. The fused kernel reads gate and up once and writes the output once:
3 passes. It is purely memory-bound (a handful of FLOPs per 6 bytes), so 3/5 of the bytes is 3/5 of the time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib.ops._common import check_tensors, launch, next_power_of_2, num_warps_for

# Columns per program. Swept on the H200 at T=8192, I=14336 bf16 (1-D grid): 1024 to 4096 columns with 4 to 16
# warps all reached 4,120-4,229 GB/s (copy: 4,151 GB/s for the same bytes), except 16 warps on 1024-2048 columns.
BLOCK = 2048


@triton.jit
def _swiglu_kernel(
    gate_ptr,  # (n_rows, n_cols), rows gate_row_stride apart, columns contiguous
    up_ptr,  # (n_rows, n_cols), rows up_row_stride apart, columns contiguous
    out_ptr,  # (n_rows, n_cols), rows out_row_stride apart, columns contiguous
    n_cols,
    gate_row_stride,
    up_row_stride,
    out_row_stride,
    BLOCK: tl.constexpr,  # columns per program
):
    # A 1-D grid walked row by row: programs launched together touch neighbouring memory. (A 2-D grid of
    # (rows, column blocks) sends them to different rows instead.)
    pid = tl.program_id(0)
    blocks_per_row = tl.cdiv(n_cols, BLOCK)
    row = (pid // blocks_per_row).to(tl.int64)  # int64: row * stride can pass 2**31 on large activations
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up  # in float32, rounded once on the store
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def config(n_cols: int, profile=None) -> dict:
    """BLOCK and warps for rows of ``n_cols`` elements.
    The same on every GPU, ``profile`` accepted for a uniform interface: the kernel keeps its elements in registers
    and needs no shared memory beyond nothing (compiled for sm_75 to sm_90: tests/ops/test_compile_targets.py)."""
    block = min(next_power_of_2(n_cols), BLOCK)
    return dict(BLOCK=block, num_warps=num_warps_for(block))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fused. gate, up: (..., I) of one shape; rows may be strided (e.g. the two halves of one
    combined gate/up projection), the last dimension must be contiguous. Returns a new contiguous tensor."""
    check_tensors("swiglu", gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dim() == 0:
        raise ValueError("swiglu: expected tensors with at least one dimension, got scalars")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    n_cols = gate.shape[-1]
    # At decode sizes each of these Python-level tensor calls costs microseconds: skip them for 2-D inputs.
    gate2d, up2d = (gate, up) if gate.dim() == 2 else (gate.reshape(-1, n_cols), up.reshape(-1, n_cols))
    meta = config(n_cols)
    launch(
        _swiglu_kernel, (gate2d.shape[0] * triton.cdiv(n_cols, meta["BLOCK"]),),
        gate2d, up2d, out, n_cols, gate2d.stride(0), up2d.stride(0), n_cols, **meta,
    )
    return out
