"""Lesson 01's checkers (notebook 01_operator_fusion): the two kernel exercises (swiglu, add_rms_norm: the student
writes the @triton.jit kernel, a launcher here launches it on guarded buffers), apply_rope, and the fused ops'
gradients."""

from __future__ import annotations

import torch

from contextlib import nullcontext

from lessonlib import reference, runtime, testing
from lessonlib.exercises._checking import (ExerciseFailed, _call, _check_output, _check_written, _describe, _diagnose,
                                           _inputs, passed)
from lessonlib.exercises._observe import certify_kernel
from lessonlib.exercises._guards import Guards, launch_guards, launch_kernel, output_like
from lessonlib.testing import to_float64


SWIGLU_SHAPES = [(1, 1), (7, 123), (33, 1000)]
ADD_RMS_NORM_SHAPES = [(1, 8), (5, 123), (16, 1000)]
SWIGLU_BLOCK = 1024  # elements per program: 4 KB of float32 per input, a few loads per thread on a GPU


# --- The launchers: given. They validate, allocate and launch the student's kernel; nothing else computes. -------


def swiglu(kernel, gate: torch.Tensor, up: torch.Tensor, guards: Guards | None = None) -> torch.Tensor:
    """Launch the exercise's swiglu kernel, one program per ``SWIGLU_BLOCK`` elements of the inputs seen as flat
    arrays (made contiguous): ``kernel[grid](gate, up, out, n_elements, BLOCK=SWIGLU_BLOCK)``. Returns ``out``
    like ``gate``. ``guards``: the checker's (:mod:`~lessonlib.exercises._guards`)."""
    import triton

    from lessonlib.ops._common import check_tensors

    check_tensors("swiglu", gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    gate, up = gate.contiguous(), up.contiguous()
    with launch_guards("swiglu", guards) as guards:
        out = output_like(guards, "out", gate)
        if gate.numel():
            launch_kernel(guards, "swiglu", kernel, (triton.cdiv(gate.numel(), SWIGLU_BLOCK),), gate, up, out, gate.numel(), BLOCK=SWIGLU_BLOCK)
    return out


def add_rms_norm(kernel, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 guards: Guards | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the exercise's add + RMSNorm kernel, one program per row of the contiguous (rows, n_cols) inputs:
    ``kernel[(rows,)](x, residual, weight, out, residual_out, n_cols, eps, BLOCK=next_power_of_2(n_cols))``.
    Returns ``(out, residual_out)``, each like ``x``."""
    from lessonlib.ops._common import check_tensors, next_power_of_2

    check_tensors("add_rms_norm", x=x, residual=residual, weight=weight)
    if x.shape != residual.shape or x.dim() < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: x and residual must have one shape (..., H) and weight (H,); got "
                         f"{tuple(x.shape)}, {tuple(residual.shape)}, {tuple(weight.shape)}")
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    n_cols = x.shape[-1]
    with launch_guards("add_rms_norm", guards) as guards:
        out, residual_out = output_like(guards, "out", x), output_like(guards, "residual_out", x)
        if x.numel():
            launch_kernel(guards, "add_rms_norm", kernel, (x.numel() // n_cols,), x, residual, weight, out, residual_out, n_cols, eps,
                   BLOCK=next_power_of_2(n_cols))
    return out, residual_out


# --- The checkers ----------------------------------------------------------------------------------------------


def _library_op_or_kernel(name: str, kernel, op, written_as: str) -> None:
    if (kernel is None) == (op is None):
        raise TypeError(f"check_{name}: pass your @triton.jit kernel ({written_as}), or op= a whole op (lessonlib's)")
    if kernel is not None:
        certify_kernel(name, kernel)


def check_swiglu(kernel=None, *, op=None) -> None:
    """``kernel``: the exercise's @triton.jit kernel, launched by :func:`swiglu` on guarded inputs; ``out`` must be
    ``silu(gate) * up``. ``op=fn``: check a whole op ``fn(gate, up)`` instead (the lesson checks lessonlib's own
    this way); a Python function passed as the kernel is refused."""
    _library_op_or_kernel("swiglu", kernel, op, "my_swiglu_kernel")
    for dtype in runtime.supported_dtypes():
        for shape in SWIGLU_SHAPES:
            gate, up = _inputs(shape, shape, dtype=dtype)
            if op is not None:
                out = _call("swiglu", op, (gate, up))
            else:
                guards = Guards("swiglu", "store silu(gate) * up = gate * sigmoid(gate) * up for its BLOCK elements")
                gate, up = guards.place("gate", gate), guards.place("up", up)
                out = guards.run(lambda: _call("swiglu", lambda g, u: swiglu(kernel, g, u, guards), (gate, up)))
            with guards.judged() if op is None else nullcontext():
                _check_swiglu_output(out, gate, up)
    what = "lessonlib's op" if op is not None else "your kernel"
    passed(f"✓ swiglu: {what} matches the reference ({len(SWIGLU_SHAPES)} shapes x every supported dtype)")


def check_add_rms_norm(kernel=None, *, op=None) -> None:
    """``kernel``: the exercise's @triton.jit kernel, launched by :func:`add_rms_norm` on guarded inputs; it must
    give ``(normalized, updated_residual)`` as the reference does. ``op=fn``: check a whole op
    ``fn(x, residual, weight, eps)`` instead (lessonlib's own); a Python function passed as the kernel is refused."""
    _library_op_or_kernel("add_rms_norm", kernel, op, "my_add_rms_norm_kernel")
    for dtype in runtime.supported_dtypes():
        for shape in ADD_RMS_NORM_SHAPES:
            x, residual, weight = _inputs(shape, shape, shape[-1:], dtype=dtype)
            if op is not None:
                result = _call("add_rms_norm", op, (x, residual, weight, 1e-6))
            else:
                guards = Guards("add_rms_norm", "store its row of residual_out = x + residual and of out = weight * RMSNorm(x + residual)")
                x, residual, weight = (guards.place(w, t) for w, t in (("x", x), ("residual", residual),
                                                                        ("weight", weight)))
                result = guards.run(lambda: _call("add_rms_norm", lambda *a: add_rms_norm(kernel, *a, guards=guards),
                                                  (x, residual, weight, 1e-6)))
            with guards.judged() if op is None else nullcontext():
                _check_add_rms_norm_output(result, x, residual, weight)
    what = "lessonlib's op" if op is not None else "your kernel"
    passed(f"✓ add_rms_norm: {what} matches the reference ({len(ADD_RMS_NORM_SHAPES)} shapes x every supported dtype)")


ROUND_ONCE = "Compute in float32 and round once when storing."


def _check_swiglu_output(out, gate, up) -> None:
    """Written, then right, else the known wrong formula it matches (in float64)."""
    truth = reference.swiglu(*to_float64(gate, up))
    _check_written("swiglu", out, truth, (gate, up))
    g, u = (t.double().cpu() for t in (gate, up))
    mistakes = [("sigmoid(gate) * up gives: silu(gate) = gate * sigmoid(gate), the gate times its own sigmoid",
                 torch.sigmoid(g) * u),
                ("silu(up) * gate gives: gate goes through silu, up is the plain factor", u * torch.sigmoid(u) * g),
                ("gate * up gives: silu(gate) = gate * sigmoid(gate), not gate alone", g * u),
                ("silu(gate) alone gives: multiply by up", g * torch.sigmoid(g)),
                ("a sigmoid written 1 / (1 + exp(x)) gives: sigmoid(x) = 1 / (1 + exp(-x))",
                 g / (1 + torch.exp(g)) * u)]
    _diagnose("swiglu", out, truth, reference.swiglu(gate, up), mistakes, _describe((gate, up)),
              testing.swiglu_allowance(gate, up), advice=ROUND_ONCE)


def _check_add_rms_norm_output(result, x, residual, weight) -> None:
    """Both outputs written, then right, else the known mistake they match (in float64)."""
    args = (x, residual, weight, 1e-6)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ExerciseFailed(f"add_rms_norm returned {type(result).__name__}; expected a tuple (normalized, "
                             "updated_residual)")
    truth = reference.add_rms_norm(*to_float64(x, residual, weight), 1e-6)
    low = reference.add_rms_norm(x, residual, weight, 1e-6)
    _check_output("add_rms_norm: updated_residual", result[1], truth[1], low[1], args)
    _check_written("add_rms_norm: normalized", result[0], truth[0], args)
    h, w = truth[1].cpu(), weight.double().cpu()
    n_cols = h.shape[-1]
    block = 1 << (n_cols - 1).bit_length()  # the launcher's BLOCK: n_cols rounded up to a power of 2

    def normed(mean_of_squares):
        return h * torch.rsqrt(mean_of_squares + 1e-6)

    squares = h.pow(2).sum(-1, keepdim=True)
    mistakes = [(f"a mean of squares over BLOCK = {block} gives: divide the sum of squares by the row's length, "
                 f"n_cols = {n_cols}, not by BLOCK (the masked lanes past n_cols add nothing to the sum)",
                 w * normed(squares / block)),
                ("RMSNorm without the weight gives: multiply by weight (loaded per column)", normed(squares / n_cols)),
                ("RMSNorm of x alone gives: normalize h = x + residual, the updated residual",
                 w * x.double().cpu() * torch.rsqrt(x.double().cpu().pow(2).mean(-1, keepdim=True) + 1e-6)),
                ("dividing by the mean of squares (no square root) gives: multiply by rsqrt(mean + eps)",
                 w * h / (squares / n_cols + 1e-6))]
    _diagnose("add_rms_norm: normalized", result[0], truth[0], low[0], mistakes, _describe(args),
              testing.rms_norm_allowance(truth[0]), advice=ROUND_ONCE)


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
    passed("✓ apply_rope matches the reference (3 shapes x every supported dtype)")


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
    passed("✓ gradients of swiglu, add_rms_norm and apply_rope match float64 autograd (odd shapes x every supported dtype)")
