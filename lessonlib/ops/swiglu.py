"""swiglu: silu(gate) * up in one kernel, and its gradient in one more.

Eager PyTorch runs two kernels: silu reads gate and writes a temporary, mul reads the temporary and up and writes
the output: 5 passes over a (T, I) tensor. The fused kernel reads gate and up once and writes the output once:
3 passes. It is purely memory-bound (a handful of FLOPs per 6 bytes), so 3/5 of the bytes is 3/5 of the time.

Backward: eager autograd keeps silu(gate) alive from the forward and runs three kernels (grad * silu, grad * up,
silu's backward): 9 passes. The fused backward keeps only gate and up (already in memory: they are the GEMM's
output), recomputes sigmoid(gate) in registers, and writes d(gate) and d(up) in one pass: 5 passes.

``swiglu`` is the op a model calls: ``torch.ops.lessonlib.swiglu`` (a ``torch.library.custom_op`` with a fake
implementation and an autograd formula) whenever autograd or torch.compile needs it, and the launcher directly
otherwise, so that a decode step pays no dispatcher time.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from lessonlib.ops._common import cdiv, check_tensors, launch, next_power_of_2, num_warps_for, tuned
from lessonlib.ops._plans import Plans

# Columns per program. Swept on the H200 at T=8192, I=14336 bf16, 1-D grid (the sweep records of
# lessonlib/results/fusion-h200.json): 2048 columns with 8 warps was the fastest, 4,239 GB/s; 1024-2048 columns with
# 4 warps and 4096 with 8-16 reached 4,217-4,227; 4096 with 4 warps 4,113; 8192 columns 3,466-4,209; 8-16 warps on
# 1024 columns and 16 on 2048 fell to 2,506-3,827. A plain copy of the same bytes ran at 4,127 GB/s: a kernel that
# reads two bytes for each one it writes can pass a copy.
BLOCK = 2048


@triton.jit
def _this_programs_block(n_cols, BLOCK: tl.constexpr):
    """This program's row and BLOCK columns. A 1-D grid walked row by row: programs launched
    together touch neighbouring memory. (A 2-D grid of (rows, column blocks) sends them to different
    rows instead.)"""
    pid = tl.program_id(0)
    blocks_per_row = tl.cdiv(n_cols, BLOCK)
    # int64: row * stride can pass 2**31 on large activations
    row = (pid // blocks_per_row).to(tl.int64)
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < n_cols


@triton.jit
def _swiglu_kernel(
    gate_ptr,  # (n_rows, n_cols), rows stride_gate_row apart, columns contiguous
    up_ptr,  # (n_rows, n_cols), rows stride_up_row apart, columns contiguous
    out_ptr,  # (n_rows, n_cols), rows stride_out_row apart, columns contiguous
    n_cols,
    stride_gate_row,
    stride_up_row,
    stride_out_row,
    BLOCK: tl.constexpr,  # columns per program
):
    row, cols, mask = _this_programs_block(n_cols, BLOCK)
    gate = tl.load(gate_ptr + row * stride_gate_row + cols, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up_row + cols, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up  # in float32, rounded once on the store
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    grad_ptr,  # (n_rows, n_cols): d(out), rows stride_grad_row apart, columns contiguous
    gate_ptr,  # (n_rows, n_cols): the forward's gate, saved, rows stride_gate_row apart
    up_ptr,  # (n_rows, n_cols): the forward's up, saved, rows stride_up_row apart
    grad_gate_ptr,  # (n_rows, n_cols) contiguous: d(gate)
    grad_up_ptr,  # (n_rows, n_cols) contiguous: d(up)
    n_cols,
    stride_grad_row,
    stride_gate_row,
    stride_up_row,
    BLOCK: tl.constexpr,  # columns per program
):
    row, cols, mask = _this_programs_block(n_cols, BLOCK)  # the forward's grid and walk
    grad = tl.load(grad_ptr + row * stride_grad_row + cols, mask=mask).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate_row + cols, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up_row + cols, mask=mask).to(tl.float32)
    # recomputed, not saved: a few FLOPs instead of a (T, I) tensor kept and re-read
    sig = tl.sigmoid(gate)
    silu = gate * sig
    # d silu(g) / dg = sig + g * sig * (1 - sig) = sig * (1 + g * (1 - sig))
    grad_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = grad * silu
    tl.store(grad_gate_ptr + row * n_cols + cols, grad_gate.to(grad_gate_ptr.dtype.element_ty),
             mask=mask)
    tl.store(grad_up_ptr + row * n_cols + cols, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_tensors("swiglu", gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape, got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")
    if gate.dim() == 0:
        raise ValueError("swiglu: expected tensors with at least one dimension, got scalars")


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    # At decode sizes each Python-level tensor call costs microseconds: skip the reshape for 2-D inputs.
    return t if t.dim() == 2 else t.reshape(-1, n_cols)


def config(n_cols: int, profile=None) -> dict:
    """BLOCK and warps for rows of ``n_cols`` elements.
    The same on every GPU, ``profile`` accepted for a uniform interface: the kernel keeps its elements in registers
    and needs no shared memory beyond nothing (compiled for sm_75 to sm_90: tests/ops/test_compile_targets.py)."""
    block = min(next_power_of_2(n_cols), BLOCK)
    return dict(BLOCK=block, num_warps=num_warps_for(block))


# The launchers' ``config`` knob shadows the name inside them. Cached per width: built afresh, the dict took 1 us of a
# decode-size call's host time (callers only read it).
_default_config = lru_cache(maxsize=1024)(config)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The forward launcher: silu(gate) * up, fused. gate, up: (..., I) of one shape; rows may be strided (e.g. the
    two halves of one combined gate/up projection), the last dimension must be contiguous. Returns a new contiguous
    tensor. No autograd: models call :func:`swiglu`. ``config`` overrides :func:`config`'s BLOCK and num_warps: a
    knob for sweeps (benchmarks/bench_fusion.py)."""
    signature = _signature(gate, up) if config is None else None
    plan = _PLANS.get(signature)
    if plan is not None:  # inputs like an earlier call's: validated and configured then (_plans.Plans)
        out = torch.empty_like(gate, memory_format=torch.contiguous_format)
        if _PLANS.launch(plan, gate.data_ptr(), up.data_ptr(), out.data_ptr()):
            return out
    _check(gate, up)
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)  # half the host time of torch.empty(shape...)
    if out.numel() == 0:
        return out
    n_cols = gate.shape[-1]
    gate2d, up2d = _rows(gate, n_cols), _rows(up, n_cols)
    meta = _default_config(n_cols) if config is None else tuned("swiglu", _default_config(n_cols), config)
    grid = (gate2d.shape[0] * cdiv(n_cols, meta["BLOCK"]),)
    args = (gate2d, up2d, out, n_cols, gate2d.stride(0), up2d.stride(0), n_cols)
    launch(_swiglu_kernel, grid, *args, **meta)
    if gate.dim() == 2:  # rows as given: a plan passes the inputs' own addresses
        _PLANS.remember(signature, grid, args, meta)
    return out


def _signature(gate, up):
    """What :func:`_check` and the launch read from the inputs (``_plans.Plans``); None for inputs without
    them (a non-tensor: the full path raises)."""
    try:
        return (gate.__class__, gate.dtype, gate.device, gate.shape, gate.stride(),
                up.__class__, up.dtype, up.device, up.shape, up.stride())
    except (AttributeError, TypeError):
        return None


_PLANS = Plans(_swiglu_kernel)


def swiglu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward launcher: ``(d gate, d up)`` from d(out) and the forward's inputs, in one kernel."""
    _check(gate, up)
    check_tensors("swiglu backward", grad_out=grad_out, gate=gate)
    if grad_out.shape != gate.shape:
        raise ValueError(f"swiglu backward: grad_out has shape {tuple(grad_out.shape)}, gate {tuple(gate.shape)}")
    grad_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    grad_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return grad_gate, grad_up
    n_cols = gate.shape[-1]
    grad2d, gate2d, up2d = _rows(grad_out, n_cols), _rows(gate, n_cols), _rows(up, n_cols)
    meta = config(n_cols)
    launch(
        _swiglu_backward_kernel, (gate2d.shape[0] * triton.cdiv(n_cols, meta["BLOCK"]),),
        grad2d, gate2d, up2d, grad_gate, grad_up, n_cols, grad2d.stride(0), gate2d.stride(0), up2d.stride(0),
        **meta,
    )
    return grad_gate, grad_up


# --- the op: torch.ops.lessonlib.swiglu, with a fake implementation and a gradient ----------------

@torch.library.custom_op("lessonlib::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return swiglu_forward(gate, up)


@_swiglu_op.register_fake
def _(gate, up):
    _check(gate, up)  # bad input fails while torch.compile traces, with the eager error
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("lessonlib::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad_out: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(grad_out, gate, up)


@_swiglu_backward_op.register_fake
def _(grad_out, gate, up):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


def _save_for_backward(ctx, inputs, output):
    # gate and up: alive anyway (the GEMM's output), so saving them costs nothing
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_out):
    gate, up = ctx.saved_tensors
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)
    return torch.ops.lessonlib.swiglu_backward(grad_out, gate, up)


_swiglu_op.register_autograd(_backward, setup_context=_save_for_backward)
_SWIGLU = torch.ops.lessonlib.swiglu.default


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fused, with a gradient: the op a model calls
    (``lessonlib.reference.swiglu``'s twin).

    gate, up: (..., I) of one shape; rows may be strided, the last dimension must be contiguous.
    Goes through the custom op ``torch.ops.lessonlib.swiglu`` when autograd must record it (an input
    requires grad, with grad enabled) or torch.compile traces it; otherwise straight to
    :func:`swiglu_forward` (the dispatcher would add host time to every decode-size call)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            getattr(gate, "requires_grad", False) or getattr(up, "requires_grad", False))):
        return _SWIGLU(gate, up)
    return swiglu_forward(gate, up)
