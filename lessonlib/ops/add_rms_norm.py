"""add_rms_norm: residual add + RMSNorm in one kernel, returning both outputs.

A pre-norm block does ``residual = x + residual; h = rms_norm(residual) * weight``. Eager PyTorch runs seven
operators for that, several with float32 temporaries; on a GPU in bf16 the two dtype casts launch one kernel each as
well (torch.profiler counted nine on the H200, lessonlib/results/fusion-h200.json). The fused kernel reads x,
residual and weight once and writes the normalized output and the updated residual once: 4 passes over a (T, H)
tensor, the minimum.

Backward: with h = x + residual (the updated residual), n = h * rstd and out = weight * n,

    d_h = d(updated residual) + rstd * (d_n - n * mean(d_n * n)),  d_n = d(out) * weight,  d(x) = d(residual) = d_h
    d(weight) = sum over rows of d(out) * n

The forward saves nothing of its own: h is one of its outputs, and rstd and n are recomputed from h in registers
(the row is loaded anyway). One program walks a run of rows and keeps its share of d(weight) in float32 registers;
the per-program partial rows are then summed by one small reduction. Every program owns its partial row, so no two
programs add into the same address (atomics on one (H,) vector from every row would serialize), and the sum is
deterministic. Liger-Kernel's and Apex's RMSNorm backward do the same.

``add_rms_norm`` is the op a model calls: ``torch.ops.lessonlib.add_rms_norm`` (a custom op with a fake and an
autograd formula) when autograd or torch.compile needs it, the launcher directly otherwise.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton.language as tl
import triton

from lessonlib import runtime
from lessonlib.ops._common import (check_tensors, launch, next_power_of_2, pdl_options, pdl_wait_then_trigger,
                                   tuned)
from lessonlib.ops._plans import Plans

# Rows up to this many elements stay in registers (one read, one write). Wider rows take two passes over the
# updated residual. Measured on the H200 (bench_fusion.py's register_pressure, 16 warps; the figures are in
# lessonlib/results/fusion-h200.json, plotted in lesson 01): one pass uses 58 registers per thread at 16384 columns
# and 127 at 32768, still faster than two passes, and spills 80 registers at 65536, where it runs at about half
# the speed of two passes.
MAX_ONE_PASS_COLS = 32768
TWO_PASS_BLOCK = 4096
ELEMENTS_PER_WARP = 2048

# One program per row. Tried on the H200 at T=8192, H=4096 bf16: a grid-stride loop with 1 to 32 programs per
# multiprocessor (weight loaded once per program) reached 2,357 to 3,772 GB/s; one program per row, 3,755 to
# 3,830 GB/s. Warps per row: 1 or 2 (128 or 64 columns per thread) 3,843 GB/s, 4: 3,825, 8 and 16: 3,804. So a
# warp takes 2048 columns (64 per thread), up to 16 warps.


@triton.jit
def _add_residual(x_ptr, residual_ptr, residual_out_ptr, cols, mask, dtype: tl.constexpr):
    """h = x + residual on these columns, stored as the updated residual; returned in float32. The
    sum is rounded to the input dtype first: that *is* the residual stream, and the statistics are
    taken over it, exactly as the reference does."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(dtype)
    tl.store(residual_out_ptr + cols, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _normalize(h, rstd, weight_ptr, out_ptr, cols, mask, dtype: tl.constexpr):
    """weight * (h * rstd), stored; h * rstd rounded to the dtype first, as the reference does."""
    w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
    out = (h * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + cols, out.to(dtype), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # (n_rows, n_cols), rows stride_x_row apart
    residual_ptr,  # (n_rows, n_cols), rows stride_residual_row apart
    weight_ptr,  # (n_cols,)
    out_ptr,  # (n_rows, n_cols) contiguous: weight * rms_norm(x + residual)
    residual_out_ptr,  # (n_rows, n_cols) contiguous: x + residual, the next layer's residual stream
    n_cols,
    stride_x_row,
    stride_residual_row,
    eps,
    BLOCK: tl.constexpr,  # columns handled at a time; the whole row when ONE_PASS
    ONE_PASS: tl.constexpr,  # n_cols <= BLOCK: keep the row in registers
    PDL: tl.constexpr = False,  # programmatic dependent launch (ops._common.pdl_options)
):
    pdl_wait_then_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * stride_x_row
    residual_ptr += row * stride_residual_row
    out_ptr += row * n_cols
    residual_out_ptr += row * n_cols
    dtype = out_ptr.dtype.element_ty

    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        h = _add_residual(x_ptr, residual_ptr, residual_out_ptr, cols, mask, dtype)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        _normalize(h, rstd, weight_ptr, out_ptr, cols, mask, dtype)
    else:
        # Pass 1: write the updated residual, accumulate the sum of squares.
        sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            h = _add_residual(x_ptr, residual_ptr, residual_out_ptr, cols, mask, dtype)
            sum_sq += h * h
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
        tl.debug_barrier()  # pass 2 reads back what pass 1 stored
        # Pass 2: read the updated residual back (one extra read of the row) and normalize.
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            h = tl.load(residual_out_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            _normalize(h, rstd, weight_ptr, out_ptr, cols, mask, dtype)


@triton.jit
def _add_rms_norm_backward_kernel(
    grad_out_ptr,  # (n_rows, n_cols): d(normalized), rows stride_grad_out_row apart
    grad_residual_out_ptr,  # (n_rows, n_cols): d(updated residual), rows stride_grad_residual_out_row apart
    residual_out_ptr,  # (n_rows, n_cols) contiguous: the forward's updated residual h, saved
    weight_ptr,  # (n_cols,)
    grad_h_ptr,  # (n_rows, n_cols) contiguous: d_h, the gradient of x and of residual alike
    partial_grad_weight_ptr,  # (n_programs, n_cols) float32: row p = sum over program p's rows of d(out) * n
    n_rows,
    n_cols,
    rows_per_program,
    stride_grad_out_row,
    stride_grad_residual_out_row,
    eps,
    BLOCK: tl.constexpr,  # columns handled at a time; the whole row when ONE_PASS
    ONE_PASS: tl.constexpr,  # n_cols <= BLOCK: the row, and this program's share of d(weight), stay in registers
):
    pid = tl.program_id(0)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    partial_ptr = partial_grad_weight_ptr + pid.to(tl.int64) * n_cols
    dtype = grad_h_ptr.dtype.element_ty

    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # once per program, not per row
        grad_w = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(first, last):
            row = tl.cast(row, tl.int64)
            h = tl.load(residual_out_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(grad_out_ptr + row * stride_grad_out_row + cols, mask=mask, other=0.0).to(tl.float32)
            g_res = tl.load(grad_residual_out_ptr + row * stride_grad_residual_out_row + cols, mask=mask, other=0.0)
            rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)  # as the forward computed it
            n = h * rstd
            grad_w += g * n.to(dtype).to(tl.float32)  # the forward multiplied weight by n rounded to the dtype
            grad_n = g * w
            grad_h = rstd * (grad_n - n * (tl.sum(grad_n * n, axis=0) / n_cols)) + g_res.to(tl.float32)
            tl.store(grad_h_ptr + row * n_cols + cols, grad_h.to(dtype), mask=mask)
        tl.store(partial_ptr + cols, grad_w, mask=mask)
    else:
        # Wide rows: two passes per row, and this program's partial row of d(weight) lives in memory (its own row:
        # no other program touches it). Pass 1 takes the row's two sums; pass 2 writes d_h and adds into d(weight).
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(partial_ptr + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=cols < n_cols)
        for row in range(first, last):
            row = tl.cast(row, tl.int64)
            sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
            sum_grad_h = tl.zeros([BLOCK], dtype=tl.float32)  # sum of d_n * h: mean(d_n * n) = rstd * sum / n_cols
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                h = tl.load(residual_out_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(grad_out_ptr + row * stride_grad_out_row + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                sum_sq += h * h
                sum_grad_h += g * w * h
            rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
            mean_grad_n = rstd * tl.sum(sum_grad_h, axis=0) / n_cols
            tl.debug_barrier()  # the partial row read below was stored by this program's previous row
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                h = tl.load(residual_out_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(grad_out_ptr + row * stride_grad_out_row + cols, mask=mask, other=0.0).to(tl.float32)
                g_res = tl.load(grad_residual_out_ptr + row * stride_grad_residual_out_row + cols, mask=mask, other=0.0)
                w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                n = h * rstd
                grad_h = rstd * (g * w - n * mean_grad_n) + g_res.to(tl.float32)
                tl.store(grad_h_ptr + row * n_cols + cols, grad_h.to(dtype), mask=mask)
                partial = tl.load(partial_ptr + cols, mask=mask, other=0.0)
                tl.store(partial_ptr + cols, partial + g * n.to(dtype).to(tl.float32), mask=mask)


def _check(x, residual, weight, eps) -> None:
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


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, n_cols)  # skip the reshape call at decode sizes


def config(n_cols: int, profile=None) -> dict:
    """BLOCK, ONE_PASS and warps for rows of ``n_cols`` elements.
    The same on every GPU, ``profile`` accepted for a uniform interface: the kernel keeps its elements in registers
    and needs no shared memory beyond the sum of squares across warps (compiled for sm_75 to sm_90: tests/ops/test_compile_targets.py)."""
    if n_cols <= MAX_ONE_PASS_COLS:
        block = next_power_of_2(n_cols)
        return dict(BLOCK=block, ONE_PASS=True, num_warps=min(16, max(1, block // ELEMENTS_PER_WARP)))
    return dict(BLOCK=TWO_PASS_BLOCK, ONE_PASS=False, num_warps=16)


_default_config = config  # the launchers' ``config`` knob shadows the name inside them


@lru_cache(maxsize=1024)
def _launch_meta(n_cols: int) -> dict:
    """The forward's constexprs and options at the default configuration: built once per width (afresh, the dicts
    took about 1 us of a decode-size call's host time on the course's CI machine; callers only read it)."""
    return {**config(n_cols), **pdl_options()}


def add_rms_norm_forward(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward launcher: fused ``residual + x`` then RMSNorm; returns ``(normalized, updated_residual)`` like
    ``lessonlib.reference.add_rms_norm``. x, residual: (..., H) of one shape; weight: (H,). No autograd: models
    call :func:`add_rms_norm`. ``config`` overrides :func:`config`'s BLOCK, ONE_PASS and num_warps: a knob for
    sweeps (benchmarks/bench_fusion.py)."""
    return _forward(x, residual, weight, eps, config)[:2]


def compiled_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                     config: dict | None = None):
    """Run the forward once and return Triton's compiled kernel (on a GPU): its ``n_regs`` (registers per thread)
    and ``n_spills`` are what the register-pressure sweep and lesson 01 read."""
    return _forward(x, residual, weight, eps, config)[2]


def _forward(x, residual, weight, eps, override):
    signature = _signature(x, residual, weight, eps) if override is None else None
    plan = _PLANS.get(signature)
    if plan is not None:  # inputs like an earlier call's: validated and configured then (_plans.Plans)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if _PLANS.launch(plan, x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                           residual_out.data_ptr()):
            return out, residual_out, plan.entry.compiled
    _check(x, residual, weight, eps)
    n_cols = x.shape[-1]
    meta = _launch_meta(n_cols) if override is None else {
        **tuned("add_rms_norm", _default_config(n_cols), override), **pdl_options()}
    if meta["ONE_PASS"] and meta["BLOCK"] < n_cols:
        raise ValueError(f"add_rms_norm: ONE_PASS needs BLOCK >= H, got BLOCK={meta['BLOCK']}, H={n_cols}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # half the host time of torch.empty(shape...)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out, residual_out, None
    x2d, residual2d = _rows(x, n_cols), _rows(residual, n_cols)
    grid = (x2d.shape[0],)
    args = (x2d, residual2d, weight, out, residual_out, n_cols, x2d.stride(0), residual2d.stride(0), float(eps))
    kernel = launch(_add_rms_norm_kernel, grid, *args, **meta)
    if x.dim() == 2:  # rows as given: a plan passes the inputs' own addresses
        _PLANS.remember(signature, grid, args, meta)
    return out, residual_out, kernel


def _signature(x, residual, weight, eps):
    """What :func:`_check` and the launch read from the inputs (``_plans.Plans``); None for inputs without
    them (a non-tensor: the full path raises) and for an ``eps`` that is not a float (a tensor's value can change)."""
    if eps.__class__ is not float:
        return None
    try:
        return (x.__class__, x.dtype, x.device, x.shape, x.stride(), residual.__class__, residual.dtype,
                residual.device, residual.shape, residual.stride(), weight.__class__, weight.dtype, weight.device,
                weight.shape, weight.stride(), eps)
    except (AttributeError, TypeError):
        return None


_PLANS = Plans(_add_rms_norm_kernel)


# Programs of the backward per multiprocessor: each walks a run of rows with its partial d(weight) in registers.
# More programs hide more memory latency but add partial rows to reduce (programs x H x 4 bytes: 4.3 MB at
# 2 x 132 SMs and H=4096, against 268 MB of row traffic at T=8192). Not yet swept on a GPU: bench_fusion.py
# times 1, 2, 4 and 8 (records "add_rms_norm backward sweep").
BACKWARD_PROGRAMS_PER_SM = 2


def _backward_programs(n_rows: int) -> int:
    profile = runtime.gpu_profile()
    target = profile.multiprocessors * BACKWARD_PROGRAMS_PER_SM if profile is not None else 4
    return max(1, min(n_rows, target))


def add_rms_norm_backward(
    grad_out: torch.Tensor, grad_residual_out: torch.Tensor, residual_out: torch.Tensor, weight: torch.Tensor,
    eps: float = 1e-6, programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward launcher: ``(d_h, d_weight)`` from the gradients of both outputs, the forward's updated residual
    h and the weight. d_h is the gradient of x and of residual alike (h = x + residual). ``programs``: how many
    programs share the rows (default: :data:`BACKWARD_PROGRAMS_PER_SM` per multiprocessor), a benchmark knob."""
    check_tensors("add_rms_norm backward", grad_out=grad_out, grad_residual_out=grad_residual_out,
                  residual_out=residual_out, weight=weight)
    if not (grad_out.shape == grad_residual_out.shape == residual_out.shape):
        raise ValueError(f"add_rms_norm backward: gradients {tuple(grad_out.shape)}, {tuple(grad_residual_out.shape)} "
                         f"and the updated residual {tuple(residual_out.shape)} must have one shape")
    n_cols = residual_out.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"add_rms_norm backward: weight must have shape ({n_cols},), got {tuple(weight.shape)}")
    residual_out = residual_out if residual_out.is_contiguous() else residual_out.contiguous()
    grad_h = torch.empty(residual_out.shape, dtype=residual_out.dtype, device=residual_out.device)
    n_rows = residual_out.numel() // n_cols if n_cols else 0
    if n_rows == 0 or n_cols == 0:
        return grad_h, torch.zeros_like(weight)  # no rows: d(weight) is an empty sum
    programs = max(1, min(n_rows, programs)) if programs else _backward_programs(n_rows)
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty(programs, n_cols, dtype=torch.float32, device=weight.device)
    grad2d, grad_res2d = _rows(grad_out, n_cols), _rows(grad_residual_out, n_cols)
    launch(
        _add_rms_norm_backward_kernel, (programs,),
        grad2d, grad_res2d, residual_out, weight, grad_h, partial, n_rows, n_cols, rows_per_program,
        grad2d.stride(0), grad_res2d.stride(0), float(eps),
        **config(n_cols),
    )
    return grad_h, partial.sum(0).to(weight.dtype)  # the second, small reduction: programs x H float32


# --- the op: torch.ops.lessonlib.add_rms_norm, with a fake implementation and a gradient ------------------------

@torch.library.custom_op("lessonlib::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_forward(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    _check(x, residual, weight, eps)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("lessonlib::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward_op(grad_out: torch.Tensor, grad_residual_out: torch.Tensor, residual_out: torch.Tensor,
                              weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_backward(grad_out, grad_residual_out, residual_out, weight, eps)


@_add_rms_norm_backward_op.register_fake
def _(grad_out, grad_residual_out, residual_out, weight, eps):
    return (torch.empty(residual_out.shape, dtype=residual_out.dtype, device=residual_out.device),
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device))


def _save_for_backward(ctx, inputs, output):
    x, residual, weight, eps = inputs
    ctx.save_for_backward(output[1], weight)  # h, an output anyway; rstd and n are recomputed from it
    ctx.eps = eps


def _backward(ctx, grad_out, grad_residual_out):
    residual_out, weight = ctx.saved_tensors
    grad_h, grad_weight = torch.ops.lessonlib.add_rms_norm_backward(
        _last_dim_contiguous(grad_out), _last_dim_contiguous(grad_residual_out), residual_out, weight, ctx.eps)
    return grad_h, grad_h, grad_weight, None  # x + residual: both inputs receive d_h (as PyTorch's add does)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # .clone, not .contiguous: an expanded gradient of no elements (from .sum() of an empty tensor) already
    # counts as contiguous, stride 0 and all.
    return t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)


_add_rms_norm_op.register_autograd(_backward, setup_context=_save_for_backward)
_ADD_RMS_NORM = torch.ops.lessonlib.add_rms_norm.default


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``residual + x`` then RMSNorm, with gradients for x, residual and weight: the op a model calls
    (``lessonlib.reference.add_rms_norm``'s twin). Returns ``(normalized, updated_residual)``. x, residual: (..., H)
    of one shape; weight: (H,). Goes through the custom op ``torch.ops.lessonlib.add_rms_norm`` when autograd must
    record it (an input requires grad, with grad enabled) or torch.compile traces it, straight to
    :func:`add_rms_norm_forward` otherwise."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            getattr(x, "requires_grad", False) or getattr(residual, "requires_grad", False)
            or getattr(weight, "requires_grad", False))):
        return _ADD_RMS_NORM(x, residual, weight, eps)
    return add_rms_norm_forward(x, residual, weight, eps)
