"""gemv: a linear layer for one token, ``y = x @ weight.T (+ bias)``, optionally with SwiGLU in its epilogue: the
serving engine's projections at batch 1.

Why a kernel: at batch 1 a decode step multiplies one row by each weight matrix, two FLOPs per weight read once,
so its time is the weight read. Lesson 07's step reads 2.47 GB of weights through 65 such products (four per layer
and the output head): 0.58 ms at the H200's copy bandwidth, but 1.12 ms of GPU time with cuBLAS (benchmarks/decisions/gemv-with-pdl.md,
session 7). Each product pays a fixed few microseconds: the next kernel starts only after the previous one has ended
and flushed its writes, and its first weight bytes arrive a DRAM latency after that. cuBLAS reads an 8 MB matrix at
about 0.9 TB/s this way.

Two things here:
- **SwiGLU in the epilogue.** ``activation="swiglu"``: the weight holds gate rows then up rows (the engine's fused
  ``gate_up_proj``); each program computes both halves' sums for its columns and writes ``silu(gate) * up``. No
  (T, 2I) intermediate, no swiglu launch.
- **Programmatic dependent launch** (Hopper and newer, :func:`lessonlib.ops._common.pdl`). The kernel is launched
  with ``launch_pdl=True``, so it may start while the kernel before it is still running. Its weights do not depend
  on that kernel: each program loads its first weight tile, then waits (``gdc_wait``) for x. The weight read of one
  product overlaps the end of the previous kernel. Measured on the H200, 16 layers' four products as one CUDA
  graph: cuBLAS + swiglu 735 us, this kernel without PDL 668 us, with PDL 555 us
  (``benchmarks/experiments/decode_layer_pdl.py``, its output in ``benchmarks/experiments/results``). Without PDL
  (a T4, an L4, an A100) the same kernel runs, waiting for nothing.

Each program owns ``BLOCK_N`` output columns and one row of x, and walks the whole of K. So each row of x reads
the weights again: for one token (or a few), not for a batch, where cuBLAS's tiles read each weight once for all
rows. Accumulation is in float32, rounded once on the store.

``gemv`` is the op a model calls: ``torch.ops.lessonlib.gemv`` (with a fake implementation) under torch.compile,
the launcher directly otherwise. No backward (an inference kernel), so inputs that require grad are refused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib import runtime
from lessonlib.ops._common import (check_tensors, gdc_launch_dependents, gdc_wait, launch, next_power_of_2,
                                   pdl_options, refuse_gradient)

ACTIVATIONS = (None, "swiglu")
MAX_ROWS = 65535  # the CUDA grid's limit on its second axis, one program row per row of x


@triton.jit
def _gemv_kernel(
    x_ptr,  # (M, K), rows stride_xm apart
    w_ptr,  # (N, K), rows stride_wn apart; SWIGLU: gate rows [0, N_OUT), up rows [N_OUT, 2 N_OUT)
    bias_ptr,  # (N,) or unused
    y_ptr,  # (M, N_OUT) contiguous
    N_OUT,
    K,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch: load weights, then wait for x
):
    """Program (n, m): columns [n * BLOCK_N, (n + 1) * BLOCK_N) of output row m."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N_OUT
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    w_up_rows = w_ptr + (cols[:, None] + N_OUT).to(tl.int64) * stride_wn + ks[None, :]  # SWIGLU: the up rows
    w_mask = col_ok[:, None] if EVEN_K else col_ok[:, None] & (ks[None, :] < K)
    # The first tile of weights (and the bias) depend on nothing the previous kernel writes: load them first.
    w = tl.load(w_rows, mask=w_mask, other=0.0)
    if SWIGLU:
        w_up = tl.load(w_up_rows, mask=w_mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SWIGLU:
            bias_up = tl.load(bias_ptr + N_OUT + cols, mask=col_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_launch_dependents()  # the next kernel may start loading its own weights
        gdc_wait()  # x is the previous kernel's output: wait until it is complete and visible
    x_row = x_ptr + row * stride_xm
    if EVEN_K:
        x = tl.load(x_row + ks).to(tl.float32)
    else:
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if SWIGLU:
        acc_up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_row + k0 + ks).to(tl.float32)
            tile_mask = w_mask
        else:
            x = tl.load(x_row + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
            tile_mask = col_ok[:, None] & (k0 + ks < K)[None, :]
        w = tl.load(w_rows + k0, mask=tile_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if SWIGLU:
            w_up = tl.load(w_up_rows + k0, mask=tile_mask, other=0.0)
            acc_up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += bias
        if SWIGLU:
            acc_up += bias_up
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    tl.store(y_ptr + row * N_OUT + cols, acc.to(y_ptr.dtype.element_ty), mask=col_ok)


def config(n_out: int, k: int, swiglu: bool) -> dict:
    """Tiles. On a GPU, 4 output columns per program (8 with SwiGLU, which reads two rows per column) and K in tiles
    of up to 2048 (1024): the best of the tiles ``benchmarks/experiments/decode_layer_pdl.py`` timed on the H200 for
    every Llama-3.2-1B projection. In the interpreter, where each program instance costs milliseconds of Python
    whatever its size, as few programs as the arrays allow."""
    if runtime.gpu_profile() is not None:  # a GPU (or compiling for one)
        block_n, block_k = (8, 1024) if swiglu else (4, 2048)
        return {"BLOCK_N": block_n, "BLOCK_K": min(block_k, next_power_of_2(k)), "num_warps": 4}
    return {"BLOCK_N": min(next_power_of_2(n_out), 256), "BLOCK_K": min(next_power_of_2(k), 256), "num_warps": 4}


def _check(x, weight, bias, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"gemv: activation must be one of {ACTIVATIONS}, got {activation!r}")
    tensors = {"x": x, "weight": weight} | ({"bias": bias} if bias is not None else {})
    check_tensors("gemv", **tensors)
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"gemv: x must be (M, K) and weight (N, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x has K={x.shape[1]} columns but weight has K={weight.shape[1]}")
    if weight.shape[1] == 0:
        raise ValueError("gemv: K must be at least 1")
    if activation == "swiglu" and weight.shape[0] % 2:
        raise ValueError(f"gemv: activation='swiglu' needs gate rows then up rows (an even N), got N={weight.shape[0]}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"gemv: x has {x.shape[0]} rows, at most {MAX_ROWS} (one per program on the grid's second "
                         "axis); gemv is for a few tokens: use F.linear for a batch")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"gemv: bias must be (N,) = ({weight.shape[0]},), got {tuple(bias.shape)}")


def gemv_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None) -> torch.Tensor:
    """The launcher behind :func:`gemv` (same arguments): launched directly, no custom-op dispatch, no gradient
    check."""
    _check(x, weight, bias, activation)
    swiglu = activation == "swiglu"
    (m, k), n = x.shape, weight.shape[0]
    n_out = n // 2 if swiglu else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    meta = config(n_out, k, swiglu)
    launch(_gemv_kernel, (triton.cdiv(n_out, meta["BLOCK_N"]), m),
           x, weight, bias if bias is not None else weight, y, n_out, k, x.stride(0), weight.stride(0),
           HAS_BIAS=bias is not None, SWIGLU=swiglu, EVEN_K=k % meta["BLOCK_K"] == 0, **meta, **pdl_options())
    return y


# --- the op: torch.ops.lessonlib.gemv, with a fake implementation, no gradient ---------------------------------

@torch.library.custom_op("lessonlib::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    return gemv_forward(x, weight, bias, activation)


@_gemv_op.register_fake
def _(x, weight, bias, activation):
    _check(x, weight, bias, activation)
    n_out = weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]
    return torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)


_GEMV = torch.ops.lessonlib.gemv.default


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         activation: str | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for a few rows, like ``lessonlib.reference.gemv``.

    x: (M, K); weight: (N, K) as ``nn.Linear`` stores it; bias: (N,) or None; last dimensions contiguous; float32,
    float16 or bfloat16 (where the GPU has it). ``activation="swiglu"``: weight holds N/2 gate rows then N/2 up
    rows; returns ``silu(x @ gate.T) * (x @ up.T)``, (M, N/2). Otherwise returns (M, N). Each row of x reads the
    whole weight: meant for M = 1 (a decode step at batch 1); M at most 65,535. No host sync: CUDA-graph safe. No
    backward. With programmatic dependent launch (Hopper) the weight and bias are read before the previous kernel
    has ended: they must not be written by the kernels just before the call (a model's weights never are).
    """
    refuse_gradient("gemv", "it has no backward: an inference kernel for decode at batch 1",
                    x=x, weight=weight, **({"bias": bias} if bias is not None else {}))
    if torch.compiler.is_compiling():
        return _GEMV(x, weight, bias, activation)
    return gemv_forward(x, weight, bias, activation)
