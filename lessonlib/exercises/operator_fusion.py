"""Lesson 01's checkers (notebook 01_operator_fusion): swiglu, add_rms_norm and apply_rope, and the fused ops'
gradients."""

from __future__ import annotations

import torch

from lessonlib import reference, runtime, testing
from lessonlib.exercises._checking import ExerciseFailed, _call, _check_output, _inputs
from lessonlib.testing import to_float64


SWIGLU_SHAPES = [(1, 1), (7, 123), (33, 1000)]
ADD_RMS_NORM_SHAPES = [(1, 8), (5, 123), (16, 1000)]


def check_swiglu(fn) -> None:
    """``fn(gate, up)`` must equal ``silu(gate) * up``."""
    for dtype in runtime.supported_dtypes():
        for shape in SWIGLU_SHAPES:
            gate, up = _inputs(shape, shape, dtype=dtype)
            out = _call("swiglu", fn, (gate, up))
            _check_output("swiglu", out, reference.swiglu(*to_float64(gate, up)), reference.swiglu(gate, up), (gate, up),
                          testing.swiglu_allowance(gate, up))
    print(f"✓ swiglu matches the reference ({len(SWIGLU_SHAPES)} shapes x every supported dtype)")


def check_add_rms_norm(fn) -> None:
    """``fn(x, residual, weight, eps)`` must return ``(normalized, updated_residual)`` as the reference does."""
    for dtype in runtime.supported_dtypes():
        for shape in ADD_RMS_NORM_SHAPES:
            x, residual, weight = _inputs(shape, shape, shape[-1:], dtype=dtype)
            args = (x, residual, weight, 1e-6)
            result = _call("add_rms_norm", fn, args)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise ExerciseFailed(f"add_rms_norm returned {type(result).__name__}; expected a tuple (normalized, updated_residual)")
            truth = reference.add_rms_norm(*to_float64(x, residual, weight), 1e-6)
            low = reference.add_rms_norm(x, residual, weight, 1e-6)
            _check_output("add_rms_norm: updated_residual", result[1], truth[1], low[1], args)
            _check_output("add_rms_norm: normalized", result[0], truth[0], low[0], args,
                          testing.rms_norm_allowance(truth[0]))
    print(f"✓ add_rms_norm matches the reference ({len(ADD_RMS_NORM_SHAPES)} shapes x every supported dtype)")


def check_apply_rope(fn) -> None:
    """``fn(q, k, cos, sin)`` must return ``(q_rot, k_rot)`` as the reference does (GQA: k has fewer heads)."""
    for dtype in runtime.supported_dtypes():
        for batch, heads, kv_heads, seq, dim in [(1, 1, 1, 1, 2), (2, 4, 2, 7, 64), (1, 8, 1, 5, 80)]:
            q, k = _inputs((batch, heads, seq, dim), (batch, kv_heads, seq, dim), dtype=dtype)
            cos, sin = reference.rope_cos_sin(torch.randint(0, 4096, (seq,), device=runtime.device()), dim, dtype=dtype)
            args = (q, k, cos, sin)
            result = _call("apply_rope", fn, args)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise ExerciseFailed(f"apply_rope returned {type(result).__name__}; expected a tuple (q_rot, k_rot)")
            truth = reference.apply_rope(*to_float64(*args))
            low = reference.apply_rope(*args)
            _check_output("apply_rope: q_rot", result[0], truth[0], low[0], args)
            _check_output("apply_rope: k_rot", result[1], truth[1], low[1], args)
    print("✓ apply_rope matches the reference (3 shapes x every supported dtype)")


def check_fused_backward() -> None:
    """The gradients of lessonlib's fused ops (swiglu, add_rms_norm, apply_rope), through autograd and their Triton
    backward kernels, against float64 autograd through the reference: odd shapes, every supported dtype, gradients
    poisoned (NaN) until the backward kernels write them. Raises AssertionError with the worst element otherwise."""
    from lessonlib import ops

    for dtype in runtime.supported_dtypes():
        for shape in SWIGLU_SHAPES:
            gate, up = _inputs(shape, shape, dtype=dtype)
            testing.check_gradients("swiglu", ops.swiglu, reference.swiglu, (gate, up), ("gate", "up"),
                                    testing.swiglu_grad_magnitudes, testing.swiglu_grad_allowances)
        for shape in ADD_RMS_NORM_SHAPES:
            x, residual, weight = _inputs(shape, shape, shape[-1:], dtype=dtype)
            testing.check_gradients("add_rms_norm", ops.add_rms_norm, reference.add_rms_norm,
                                    (x, residual, weight, 1e-6), ("x", "residual", "weight", None),
                                    testing.add_rms_norm_grad_magnitudes, testing.add_rms_norm_grad_allowances)
        q, k = _inputs((2, 4, 7, 64), (2, 2, 7, 64), dtype=dtype)
        cos, sin = reference.rope_cos_sin(torch.arange(7, device=runtime.device()), 64, dtype=dtype)
        testing.check_gradients("apply_rope", ops.apply_rope, reference.apply_rope, (q, k, cos, sin),
                                ("q", "k", None, None))
    print("✓ gradients of swiglu, add_rms_norm and apply_rope match float64 autograd (odd shapes x every supported dtype)")
