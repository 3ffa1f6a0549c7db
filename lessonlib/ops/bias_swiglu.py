"""bias_swiglu: silu(gate + gate_bias) * (up + up_bias) in one kernel: "bias + activation + multiply".

The name says what it is: :mod:`lessonlib.ops.swiglu` with the two biases a gated MLP built from ``nn.Linear(...,
bias=True)`` adds after its GEMMs (GPT-NeoX-style and many vision models keep them; Llama's do not). When the GEMM
itself cannot take the bias in its epilogue (cuBLAS's plain GEMM, a quantised GEMM), eager PyTorch runs four kernels
after it: add, silu, add, mul: 9 passes over a (T, I) tensor (the biases are tiny). The fused kernel reads gate, up
and the two bias rows once and writes the output once: 3 passes. Purely memory-bound, like swiglu.

Forward only: an inference kernel (training would want swiglu's backward with two bias sums added).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib.ops._common import check_tensors, launch, refuse_gradient
from lessonlib.ops.swiglu import _this_programs_block, config


@triton.jit
def _bias_swiglu_kernel(
    gate_ptr,  # (n_rows, n_cols), rows stride_gate_row apart, columns contiguous
    up_ptr,  # (n_rows, n_cols), rows stride_up_row apart, columns contiguous
    gate_bias_ptr,  # (n_cols,) contiguous
    up_bias_ptr,  # (n_cols,) contiguous
    out_ptr,  # (n_rows, n_cols) contiguous
    n_cols,
    stride_gate_row,
    stride_up_row,
    # columns per program: swiglu's sweep (the same bytes per element, plus the bias rows)
    BLOCK: tl.constexpr,
):
    row, cols, mask = _this_programs_block(n_cols, BLOCK)
    gate = tl.load(gate_ptr + row * stride_gate_row + cols, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up_row + cols, mask=mask).to(tl.float32)
    # The bias rows are n_cols elements for all n_rows rows: after the first rows they come from L2,
    # not DRAM.
    gate = gate + tl.load(gate_bias_ptr + cols, mask=mask).to(tl.float32)
    up = up + tl.load(up_bias_ptr + cols, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up  # in float32, rounded once on the store
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(gate, up, gate_bias, up_bias) -> None:
    check_tensors("bias_swiglu", gate=gate, up=up, gate_bias=gate_bias, up_bias=up_bias)
    if gate.shape != up.shape:
        raise ValueError(f"bias_swiglu: gate and up must have the same shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.dim() == 0:
        raise ValueError("bias_swiglu: expected tensors with at least one dimension, got scalars")
    for name, bias in (("gate_bias", gate_bias), ("up_bias", up_bias)):
        if tuple(bias.shape) != (gate.shape[-1],):
            raise ValueError(f"bias_swiglu: {name} must be (I,) = ({gate.shape[-1]},), the last dimension of gate, "
                             f"got {tuple(bias.shape)}")


def bias_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor, up_bias: torch.Tensor) -> torch.Tensor:
    """silu(gate + gate_bias) * (up + up_bias), fused (``lessonlib.reference.bias_swiglu``'s twin).

    gate, up: (..., I) of one shape; rows may be strided (the halves of one gate/up projection), the last dimension
    contiguous. gate_bias, up_bias: (I,). One dtype for all four. Returns a new contiguous (..., I) tensor. No
    backward: inputs that require grad are refused outside ``torch.no_grad()``."""
    refuse_gradient("bias_swiglu", "it has no backward: an inference kernel",
                    gate=gate, up=up, gate_bias=gate_bias, up_bias=up_bias)
    _check(gate, up, gate_bias, up_bias)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    n_cols = gate.shape[-1]
    gate2d = gate if gate.dim() == 2 else gate.reshape(-1, n_cols)
    up2d = up if up.dim() == 2 else up.reshape(-1, n_cols)
    meta = config(n_cols)
    launch(_bias_swiglu_kernel, (gate2d.shape[0] * triton.cdiv(n_cols, meta["BLOCK"]),),
           gate2d, up2d, gate_bias, up_bias, out, n_cols, gate2d.stride(0), up2d.stride(0), **meta)
    return out
