"""What every checker shares: the failure it raises, calling the student's function with outputs poisoned, and comparing
an output with the float64 truth under the tolerance rule of :mod:`lessonlib.testing`.

Kernel exercises (issue 15): the student writes the kernels. Each exercise has a launcher (given: it validates
the inputs and launches the student's @triton.jit kernel), a checker that runs it on odd shapes with outputs
poisoned, and a diagnosis: when the output is wrong, the checker compares it with what known mistakes produce
(computed in float64 PyTorch) and names the mistake it matches. A stub compiles (its body is `pass`) and leaves
the output NaN or zero: both are reported as "not implemented yet".

:func:`_diagnose` and :func:`_not_implemented_output` serve those kernel exercises.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from contextlib import contextmanager

import torch

from lessonlib import runtime
from lessonlib.testing import check_close, poisoned_outputs


def passed(message: str) -> None:
    """Print a checker's verdict in lines of at most ``runtime.PRINT_WIDTH``, broken between words (continuation
    lines indented): JupyterLab breaks a longer line wherever its output area ends, inside a number too."""
    print(textwrap.fill(message, runtime.PRINT_WIDTH, subsequent_indent="  ", break_long_words=False,
                        break_on_hyphens=False))


class ExerciseFailed(AssertionError):
    """The student's code does not (yet) meet the exercise's spec; the message says why.

    In IPython (Jupyter) the failure shows as its message alone, not as a traceback through lessonlib's checker:
    the student's own error, where there is one, is named in the message. The exception is raised, so the cell
    fails (an instructor notebook's nbval run too), ``pytest.raises`` sees it, and the grader
    (:mod:`lessonlib.grading`) reads its name and message; a student copy's checker cell shows it instead
    (:func:`reported`)."""

    named = False  # True when the message names a known mistake (else a recorded read outside is named instead)

    def _render_traceback_(self) -> list[str]:
        lines = str(self).splitlines() or [""]
        return [f"\x1b[31m✗ {lines[0]}\x1b[0m", *lines[1:]]


@contextmanager
def reported(stub: str):
    """A student copy's checker cell runs its check inside this: an :class:`ExerciseFailed` is written to stderr,
    its first line in red and naming ``stub`` (what the student writes), and the cell ends without an error, so
    "Run all" goes on to the lesson's later cells (which use lessonlib's own version) on Colab too, which stops at
    the first cell that raises whatever its tags say. Any other exception propagates. Under nbgrader's autograde and
    validate (``NBGRADER_EXECUTION`` set) the failure is raised, as nbgrader grades by it; lessonlib's grader runs
    the instructor's plain checker cell instead."""
    try:
        yield
    except ExerciseFailed as e:
        if os.environ.get("NBGRADER_EXECUTION"):
            raise
        first, *rest = e._render_traceback_()
        print(first.replace("✗ ", f"✗ {stub}: ", 1), *rest, sep="\n", file=sys.stderr)


def _require_kernel(name: str, kernel, written_as: str = "") -> None:
    """Kernel exercises take the student's own @triton.jit kernel and launch it: anything else (a Python function,
    a look-alike object, a subclass, lessonlib's kernel) is refused before anything runs
    (:func:`~lessonlib.exercises._observe.certify_kernel`)."""
    from lessonlib.exercises._observe import certify_kernel

    certify_kernel(name, kernel)


def _describe(args) -> str:
    shapes = ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
    return f"inputs of shapes {shapes}, dtype {str(args[0].dtype).removeprefix('torch.')}"


def _call(name: str, fn, args):
    try:
        with poisoned_outputs():
            return fn(*args)
    except ExerciseFailed:  # a launcher's own finding (a write outside the output): already says what to fix
        raise
    except NotImplementedError as e:
        raise ExerciseFailed(f"{name}: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
    except Exception as e:  # the student's bug: say where it happened
        raise _student_error(name, e, args) from e


_MISSING_CAST = (  # (what Triton says, in 3.6 and 3.9, the named mistake)
    (re.compile(r"Expected dtype \[.*fp32.*\] but got (\w+)"),
     "a math function (tl.exp, tl.sigmoid, tl.rsqrt, ...) got {0} values, and it takes float32: a missing cast. "
     "Convert what you load, x = tl.load(...).to(tl.float32), and convert the result back when storing, "
     ".to(out_ptr.dtype.element_ty)"),
    (re.compile(r"Both operands must be same dtype\. Got (\w+) and (\w+)"),
     "tl.dot got operands of two dtypes, {0} and {1}: a missing cast. Cast one to the other's dtype, e.g. "
     "tl.dot(p.to(v.dtype), v)"),
)


def _student_error(name: str, e: Exception, args) -> ExerciseFailed:
    """The student's exception as one line: a known mistake named (a missing cast), else where it happened."""
    text = str(e)
    for pattern, explanation in _MISSING_CAST:
        found = pattern.search(text)
        if found:
            return _named(f"{name}: on {_describe(args)}, {explanation.format(*found.groups())}.")
    first_line = text.splitlines()[0] if text else ""
    return ExerciseFailed(f"{name} raised {type(e).__name__} on {_describe(args)}: {first_line}")


def _check_written(name: str, out, truth: torch.Tensor, args) -> None:
    """``out`` is a tensor of the truth's shape, every element written (poisoned outputs start NaN)."""
    if not isinstance(out, torch.Tensor):
        raise ExerciseFailed(f"{name} returned {type(out).__name__}; expected a torch.Tensor")
    if tuple(out.shape) != tuple(truth.shape):
        raise ExerciseFailed(f"{name} returned shape {tuple(out.shape)} for {_describe(args)}; expected {tuple(truth.shape)}")
    if out.is_floating_point() and out.numel():
        written = int((~torch.isnan(out)).sum())
        if written == 0:
            raise ExerciseFailed(
                f"{name}: not implemented yet: the kernel wrote none of the output (every element is still NaN, "
                "the value these checks fill new outputs with). Write the kernel's body where it says YOUR CODE "
                "HERE."
            )
        if written < out.numel():
            first = tuple(int(i) for i in torch.isnan(out).nonzero()[0])
            raise ExerciseFailed(
                f"{name} wrote only {written} of {out.numel()} output elements for {_describe(args)} (first one "
                f"missing at index {first}): does your grid cover every row and block, and your mask every column?"
            )


def _check_output(name: str, out, truth: torch.Tensor, low: torch.Tensor, args, allowance: float = 0.0) -> None:
    _check_written(name, out, truth, args)
    try:
        check_close(name, out, truth, low, allowance=allowance)
    except AssertionError as e:
        raise ExerciseFailed(f"{e}\n  on {_describe(args)}. Compute in float32 and round once when storing.") from None


def _inputs(*shapes, dtype):
    return [torch.randn(s, device=runtime.device(), dtype=torch.float32).to(dtype) for s in shapes]


def _not_implemented_output(name: str, out: torch.Tensor, truth: torch.Tensor) -> None:
    """An all-zero output where the truth is not zero: the state a stub leaves (acc = 0, or nothing loaded)."""
    if out.numel() and not out.isnan().any() and not out.any() and truth.abs().max() > 0:
        raise ExerciseFailed(f"{name}: not implemented yet: your kernel wrote zeros everywhere (the state it starts "
                             "from). Fill in the part marked YOUR CODE HERE.")


def _diagnose(name: str, out: torch.Tensor, truth: torch.Tensor, low: torch.Tensor, mistakes, where: str,
              allowance: float = 0.0, advice: str = "") -> None:
    """Pass if ``out`` is within the tolerance rule of ``truth``; else name the closest known mistake whose float64
    output ``out`` matches (within the same tolerance) and which differs from the truth, else report the error.
    ``mistakes``: (explanation, float64 output) pairs, or a callable returning them (computed only on failure).
    ``allowance``: attention's score roundings (``testing.attention_allowance``); ``advice``: a last line for a
    failure that matches no known mistake."""
    try:
        check_close(name, out, truth, low, allowance=allowance)
        return
    except AssertionError as e:
        failure = str(e)
    if out.isnan().any():
        raise ExerciseFailed(f"{failure}\n  on {where}")
    failure = f"{failure}\n  on {where}" + (f". {advice}" if advice else "")
    from lessonlib.testing import tolerance

    truth = truth.cpu()  # a GPU run's float64 truth, beside the CPU copies below
    allowed = tolerance(truth, low.cpu(), out.dtype) + allowance
    got = out.detach().double().cpu()
    matches = []
    for explanation, wrong in (mistakes() if callable(mistakes) else mistakes):
        wrong = wrong.detach().double().cpu()
        off = (wrong - truth).abs().max().item()
        distance = (got - wrong).abs().max().item()
        # A mistake's own low-precision error is not known: allow 4x the truth's tolerance and 2% of how far the
        # mistake lies from the truth, far closer than any other wrong answer comes.
        if off > allowed and distance <= 4 * allowed + 0.02 * off:
            matches.append((distance, explanation))
    if matches:
        # The closest known mistake: on a tiny input two mistakes can both lie within the band (at head_dim 2 a
        # flipped sign of sin and a wrong second half differ by 2 * x2 * sin, below 2% of x1 * sin in ~1% of draws).
        explanation = min(matches, key=lambda m: m[0])[1]
        raise _named(f"{name}: wrong values on {where}. They are what {explanation}")
    raise ExerciseFailed(failure)


def _named(message: str) -> ExerciseFailed:
    """A failure naming a known mistake: shown even where the launch also read outside a tensor."""
    failure = ExerciseFailed(message)
    failure.named = True
    return failure
