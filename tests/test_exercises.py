"""The checkers must pass lessonlib's kernels and fail every kind of wrong answer with a message that helps. Lesson 01's
kernel checkers check a whole op given as ``op=`` (how the lesson checks lessonlib's own) with the same output rules
as the student's kernel; the kernel path itself is tested in tests/test_kernel_exercises.py."""

import pytest
import torch

from lessonlib import ops, reference
from lessonlib.exercises import ExerciseFailed, check_add_rms_norm, check_apply_rope, check_swiglu


def test_checkers_pass_the_library_kernels(capsys):
    check_swiglu(op=ops.swiglu)
    check_add_rms_norm(op=ops.add_rms_norm)
    check_apply_rope(ops.apply_rope)
    assert capsys.readouterr().out.count("✓") == 3


def not_implemented(*args):
    raise NotImplementedError


def writes_nothing(gate, up):
    return torch.empty_like(gate)  # the checker's poison stays: a kernel body that is still `pass`


def writes_first_row_only(gate, up):
    out = torch.empty_like(gate)
    out[:1] = reference.swiglu(gate[:1], up[:1])
    return out


def silu_only(gate, up):
    return torch.nn.functional.silu(gate)


def transposed(gate, up):
    return reference.swiglu(gate, up).t()


def crashes(gate, up):
    return reference.swiglu(gate, up).reshape(3, -1)  # no (1, 1) input has a multiple of 3 elements


def off_by_a_few_units(gate, up):
    # 8 units of rounding at every element: more than 2x the reference's error (half a unit) + 2 roundings.
    out = reference.swiglu(gate, up)
    return out + out.abs() * torch.finfo(out.dtype).eps * 8


@pytest.mark.parametrize(
    "fn, message",
    [
        (not_implemented, "not implemented yet"),
        (writes_nothing, "wrote none of the output"),
        (writes_first_row_only, "wrote only"),
        (silu_only, "silu\\(gate\\) alone gives: multiply by up"),
        (transposed, "returned shape"),
        (crashes, "raised RuntimeError"),
        (off_by_a_few_units, "max error"),
        (lambda gate, up: None, "returned NoneType"),
    ],
)
def test_check_swiglu_explains_wrong_answers(fn, message):
    with pytest.raises(ExerciseFailed, match=message):
        check_swiglu(op=fn)


@pytest.mark.parametrize("check, fn", [(check_swiglu, lambda gate, up: torch.nn.functional.silu(gate) * up),
                                       (check_add_rms_norm, reference.add_rms_norm), (check_swiglu, ops.swiglu)])
def test_kernel_checkers_refuse_a_python_function_as_the_kernel(check, fn, capsys):
    """The issue's bypass: plain PyTorch (or lessonlib's op) where the exercise asks for a @triton.jit kernel."""
    with pytest.raises(ExerciseFailed, match="pass your @triton.jit kernel"):
        check(fn)
    assert "✓" not in capsys.readouterr().out


def test_check_add_rms_norm_explains_wrong_answers():
    with pytest.raises(ExerciseFailed, match="expected a tuple"):
        check_add_rms_norm(op=lambda x, r, w, eps: reference.add_rms_norm(x, r, w, eps)[0])
    with pytest.raises(ExerciseFailed, match="updated_residual"):
        check_add_rms_norm(op=lambda x, r, w, eps: (reference.add_rms_norm(x, r, w, eps)[0], x))
    with pytest.raises(ExerciseFailed, match="normalized"):  # forgot the weight
        check_add_rms_norm(op=lambda x, r, w, eps: reference.add_rms_norm(x, r, torch.ones_like(w), eps))


def test_check_apply_rope_catches_the_other_rotation_convention():
    def interleaved(q, k, cos, sin):  # rotates pairs (x0, x1), (x2, x3)... : GPT-J style, not rotate_half
        def rot(x):
            x1, x2 = x[..., ::2], x[..., 1::2]
            return torch.stack((-x2, x1), dim=-1).flatten(-2)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    with pytest.raises(ExerciseFailed, match="q_rot"):
        check_apply_rope(interleaved)


def test_check_fused_backward_passes_on_the_library_kernels(capsys):
    from lessonlib.exercises import check_fused_backward

    check_fused_backward()
    assert "✓ gradients" in capsys.readouterr().out
