"""Checking a fast kernel against its reference: used by tests/ and by the exercise checkers alike.

Tolerance, derived rather than guessed (flash-attention's rule): compute the reference twice, once in float64
(the truth) and once in the kernel's own dtype with plain PyTorch (what an honest low-precision implementation
gets). The kernel passes when its worst error against the truth is at most twice the worst error of that
low-precision reference, plus two units of rounding of the output dtype at the output's largest magnitude. The
two units are the fused kernel's right to round at other steps than eager PyTorch does: it keeps intermediates in
float32 and reduces in another order (for add_rms_norm in float32 that alone measured up to 1.6 units, where the
PyTorch reference, whose statistic is nearly exact, stays at half a unit). NaN or Inf where the truth is finite
never passes.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

ERROR_FACTOR = 2.0
ROUNDINGS = 2


def to_float64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to(torch.float64) for t in tensors]


def tolerance(truth: torch.Tensor, low_precision: torch.Tensor, dtype: torch.dtype,
              magnitude: float | None = None) -> float:
    reference_error = (low_precision.double() - truth).abs().max().item() if truth.numel() else 0.0
    if magnitude is None:
        magnitude = truth.abs().max().item() if truth.numel() else 0.0
    rounding = torch.finfo(dtype).eps * max(magnitude, 1e-30)
    return ERROR_FACTOR * reference_error + ROUNDINGS * rounding


def check_close(name: str, out: torch.Tensor, truth: torch.Tensor, low_precision: torch.Tensor,
                magnitude: float | None = None) -> None:
    """Raise AssertionError, with a message a student can act on, unless ``out`` is as close to the float64
    ``truth`` as the tolerance above allows.

    ``magnitude``: where an output is a sum of terms that cancel (a gradient through softmax: P * (dP - delta),
    exactly 0 when a query sees a single key), the roundings are those of the terms, not of the small result; pass
    the terms' largest magnitude. By default it is the output's."""
    if tuple(out.shape) != tuple(truth.shape):
        raise AssertionError(f"{name}: shape {tuple(out.shape)}, expected {tuple(truth.shape)}")
    if out.dtype != low_precision.dtype:
        raise AssertionError(f"{name}: dtype {out.dtype}, expected {low_precision.dtype} (the input dtype)")
    got = out.detach().double().cpu()
    truth = truth.cpu()
    bad = ~torch.isfinite(got) & torch.isfinite(truth)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {got.numel()} elements are NaN/Inf (first at index {first}); "
            "outputs start as NaN in these checks, so these elements were probably never written"
        )
    err = (got - truth).abs()
    tol = tolerance(truth, low_precision.cpu(), out.dtype, magnitude)
    worst = err.max().item() if err.numel() else 0.0
    if worst > tol:
        where = tuple(int(i) for i in (err == err.max()).nonzero()[0])
        raise AssertionError(
            f"{name}: max error {worst:.3g} at index {where} (got {got[where].item():.6g}, expected "
            f"{truth[where].item():.6g}); allowed {tol:.3g} = {ERROR_FACTOR:g} x the {out.dtype} reference's own "
            f"error + {ROUNDINGS} roundings"
        )


def _nan_filled(factory):
    def make(*args, **kwargs):
        t = factory(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    return make


@contextlib.contextmanager
def poisoned_outputs():
    """Inside this block, ``torch.empty`` and ``torch.empty_like`` return NaN-filled tensors, so any output
    element a kernel fails to write shows up as NaN instead of as leftover memory that happens to look right."""
    with mock.patch.object(torch, "empty", _nan_filled(torch.empty)), \
            mock.patch.object(torch, "empty_like", _nan_filled(torch.empty_like)):
        yield
