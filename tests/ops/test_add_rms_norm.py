import pytest
import torch

from lessonlib import ops, reference
from lessonlib.ops.add_rms_norm import MAX_ONE_PASS_COLS
from lessonlib.testing import (add_rms_norm_grad_allowances, add_rms_norm_grad_magnitudes, check_close, check_gradients,
                               poisoned_outputs, rms_norm_allowance, to_float64)
from tests.conftest import DEVICE, randn


@pytest.mark.parametrize("shape", [(1, 1), (300,), (7, 123), (3, 4, 1000), (2, 5120), (1, 14336),
                                   (2, MAX_ONE_PASS_COLS + 777)])
def test_add_rms_norm_matches_reference(shape, dtype):
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, scale=4)
    weight = randn(shape[-1], dtype=dtype)
    with poisoned_outputs():
        out, residual_out = ops.add_rms_norm(x, residual, weight, eps=1e-5)
    truth = reference.add_rms_norm(*to_float64(x, residual, weight), eps=1e-5)
    low = reference.add_rms_norm(x, residual, weight, eps=1e-5)
    check_close("add_rms_norm normalized", out, truth[0], low[0], allowance=rms_norm_allowance(truth[0]))
    # The updated residual is one rounded add: it must equal PyTorch's bit for bit.
    torch.testing.assert_close(residual_out, low[1], rtol=0, atol=0)


def test_add_rms_norm_strided_rows(dtype):
    x = randn(6, 2 * 96, dtype=dtype)[:, :96]  # rows 192 apart
    residual = randn(6, 96, dtype=dtype)
    weight = randn(96, dtype=dtype)
    with poisoned_outputs():
        out, residual_out = ops.add_rms_norm(x, residual, weight)
    truth = reference.add_rms_norm(*to_float64(x, residual, weight))[0]
    check_close("add_rms_norm normalized", out, truth, reference.add_rms_norm(x, residual, weight)[0],
                allowance=rms_norm_allowance(truth))
    torch.testing.assert_close(residual_out, x + residual, rtol=0, atol=0)


def test_add_rms_norm_does_not_modify_inputs():
    x, residual, weight = randn(3, 64), randn(3, 64), randn(64)
    before = [t.clone() for t in (x, residual, weight)]
    ops.add_rms_norm(x, residual, weight)
    for t, b in zip((x, residual, weight), before):
        assert torch.equal(t, b)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (lambda: (randn(4, 8), randn(4, 9), randn(8)), ValueError, "same shape"),
        (lambda: (randn(4, 8), randn(4, 8), randn(9)), ValueError, r"weight must have shape \(8,\)"),
        (lambda: (randn(4, 8), randn(4, 8), randn(4, 8)), ValueError, "weight must have shape"),
        (lambda: (randn(4, 8), randn(4, 8, dtype=torch.float16), randn(8)), TypeError, "mixed dtypes"),
        (lambda: (randn(4, 8), randn(4, 8), randn(8, dtype=torch.float16)), TypeError, "mixed dtypes"),
        (lambda: (randn(8, 4).t(), randn(4, 8), randn(8)), ValueError, "contiguous"),
        (lambda: (torch.ones(4, 8, dtype=torch.int64, device=DEVICE),) * 2 + (torch.ones(8, dtype=torch.int64, device=DEVICE),), TypeError, "dtype"),
    ],
)
def test_add_rms_norm_rejects_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        ops.add_rms_norm(*args())


def test_add_rms_norm_rejects_negative_eps():
    with pytest.raises(ValueError, match="eps"):
        ops.add_rms_norm(randn(2, 8), randn(2, 8), randn(8), eps=-1.0)


def test_add_rms_norm_many_rows(dtype):
    # 1500 rows: the forward launches one program per row (see the sweep above _add_rms_norm_kernel), so this is a
    # large grid of short rows. Programs that walk several rows are the backward's (BACKWARD_PROGRAMS_PER_SM per
    # multiprocessor): tested by the gradient tests below.
    x, residual, weight = randn(1500, 33, dtype=dtype), randn(1500, 33, dtype=dtype), randn(33, dtype=dtype)
    with poisoned_outputs():
        out, residual_out = ops.add_rms_norm(x, residual, weight)
    truth = reference.add_rms_norm(*to_float64(x, residual, weight))[0]
    check_close("add_rms_norm normalized", out, truth, reference.add_rms_norm(x, residual, weight)[0],
                allowance=rms_norm_allowance(truth))
    torch.testing.assert_close(residual_out, x + residual, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (3, 4, 50), (37, 24), (2, MAX_ONE_PASS_COLS + 777)])
def test_add_rms_norm_gradients_match_float64_autograd(shape, dtype):
    # (37, 24): more rows than backward programs (4 in the interpreter), so programs walk uneven runs of rows and
    # the partial weight gradients are reduced; the last shape takes the two-pass backward.
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, scale=4)
    weight = randn(shape[-1], dtype=dtype)
    check_gradients("add_rms_norm", ops.add_rms_norm, reference.add_rms_norm, (x, residual, weight, 1e-5),
                    ("x", "residual", "weight", None), add_rms_norm_grad_magnitudes, add_rms_norm_grad_allowances)


def test_add_rms_norm_backward_programs_do_not_change_the_result():
    # Any split of the rows over programs gives the same gradients up to float32 summation order.
    grad, grad_res, h, weight = randn(29, 40), randn(29, 40), randn(29, 40), randn(40)
    from lessonlib.ops.add_rms_norm import add_rms_norm_backward

    one = add_rms_norm_backward(grad, grad_res, h, weight, programs=1)
    for programs in (3, 29, 100):
        with poisoned_outputs():
            other = add_rms_norm_backward(grad, grad_res, h, weight, programs=programs)
        torch.testing.assert_close(other[0], one[0], rtol=0, atol=0)  # per-row work: identical
        torch.testing.assert_close(other[1], one[1], rtol=1e-5, atol=1e-5)


def test_add_rms_norm_weight_gradient_of_no_rows_is_zero():
    weight = randn(16).requires_grad_()
    normed, _ = ops.add_rms_norm(randn(0, 16), randn(0, 16), weight)
    normed.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("config", [dict(num_warps=1), dict(BLOCK=128, ONE_PASS=False), dict(BLOCK=1024, ONE_PASS=True)])
def test_add_rms_norm_config_knob_sweeps_without_changing_the_result(config, dtype):
    # The sweeps in benchmarks/bench_fusion.py (warps, one pass against two) and lesson 01 go through this knob.
    from lessonlib.ops.add_rms_norm import add_rms_norm_forward

    x, residual, weight = randn(3, 700, dtype=dtype), randn(3, 700, dtype=dtype, scale=4), randn(700, dtype=dtype)
    with poisoned_outputs():
        out, residual_out = add_rms_norm_forward(x, residual, weight, 1e-5, config=config)
    low = reference.add_rms_norm(x, residual, weight, eps=1e-5)
    truth = reference.add_rms_norm(*to_float64(x, residual, weight), eps=1e-5)[0]
    check_close("add_rms_norm", out, truth, low[0], allowance=rms_norm_allowance(truth))
    torch.testing.assert_close(residual_out, low[1], rtol=0, atol=0)


@pytest.mark.parametrize("config, message", [(dict(BLOCK=256, ONE_PASS=True), "ONE_PASS needs BLOCK >= H"),
                                             (dict(BLOCK=300), "power of 2"), (dict(programs=2), "unknown")])
def test_add_rms_norm_config_knob_rejects_bad_settings(config, message):
    from lessonlib.ops.add_rms_norm import add_rms_norm_forward

    with pytest.raises(ValueError, match=message):
        add_rms_norm_forward(randn(2, 700), randn(2, 700), randn(700), config=config)


class _NoMeanTermBackward(torch.autograd.Function):
    """add_rms_norm with a known backward mistake: d_h = rstd * d_n, the n * mean(d_n * n) term left out."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        out, h = reference.add_rms_norm(x, residual, weight, eps)
        ctx.save_for_backward(h, weight)
        ctx.eps = eps
        return out, h

    @staticmethod
    def backward(ctx, grad_out, grad_residual):
        h, weight = ctx.saved_tensors
        hf = h.float()
        rstd = torch.rsqrt(hf.square().mean(-1, keepdim=True) + ctx.eps)
        d_h = (rstd * grad_out.float() * weight.float() + grad_residual.float()).to(h.dtype)
        d_weight = (grad_out.float() * hf * rstd).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
        return d_h, d_h, d_weight, None


@pytest.mark.parametrize("shape", [(7, 123), (37, 24)])
def test_add_rms_norm_gradient_allowances_still_catch_a_wrong_backward(shape, dtype):
    if dtype == torch.bfloat16:
        pytest.skip("in bfloat16 the tolerance (an 8-bit mantissa's roundings) is wider than this mistake at these "
                    "rows: the H200 let the wrong backward pass; float16 and float32 show the allowances catch it")
    # The terms' magnitudes and rstd's allowance widen the tolerance where the result cancels; a backward that
    # leaves out the mean term is off by rstd * |n| * mean|d_n * n|, a whole term, and must still fail (measured:
    # 5.6x the tolerance at least in float16). Rows of many elements, so the mistake's largest size does not hang
    # on one random gradient: at (1, 1) in float16 a small d_n hid under d(residual_out)'s rounding, 1 run in 5.
    x, residual = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, scale=4)
    weight = randn(shape[-1], dtype=dtype)
    with pytest.raises(AssertionError, match="dx: max error"):
        check_gradients("add_rms_norm", _NoMeanTermBackward.apply, reference.add_rms_norm,
                        (x, residual, weight, 1e-5), ("x", "residual", "weight", None),
                        add_rms_norm_grad_magnitudes, add_rms_norm_grad_allowances)
