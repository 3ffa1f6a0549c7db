import re

import pytest
import torch

from lessonlib import ops, reference, runtime
from lessonlib.testing import (check_close, check_gradients, poisoned_outputs, swiglu_allowance, swiglu_grad_allowances,
                               swiglu_grad_magnitudes, to_float64)
from tests.conftest import DEVICE, DTYPES, randn


@pytest.mark.parametrize("shape", [(1, 1), (300,), (7, 123), (3, 5, 1000), (2, 2049), (4, 5120)])
def test_swiglu_matches_reference(shape, dtype):
    gate, up = randn(*shape, dtype=dtype, scale=3), randn(*shape, dtype=dtype)
    with poisoned_outputs():
        out = ops.swiglu(gate, up)
    check_close("swiglu", out, reference.swiglu(*to_float64(gate, up)), reference.swiglu(gate, up),
                allowance=swiglu_allowance(gate, up))


def test_swiglu_on_strided_halves_of_one_projection(dtype):
    # The combined gate/up GEMM's output, split in two views whose rows are 2I apart.
    gate, up = randn(9, 2 * 300, dtype=dtype).chunk(2, dim=-1)
    assert gate.stride(0) == 600 and not gate.is_contiguous()
    with poisoned_outputs():
        out = ops.swiglu(gate, up)
    check_close("swiglu", out, reference.swiglu(*to_float64(gate, up)), reference.swiglu(gate, up),
                allowance=swiglu_allowance(gate, up))


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 5), (0,)])
def test_swiglu_empty(shape):
    assert ops.swiglu(randn(*shape), randn(*shape)).shape == shape


@pytest.mark.parametrize(
    "gate, up, error, message",
    [
        (lambda: randn(4, 8), lambda: randn(4, 9), ValueError, "same shape"),
        (lambda: randn(4, 8), lambda: randn(4, 8, dtype=torch.float16), TypeError, "mixed dtypes"),
        (lambda: torch.ones(4, 8, dtype=torch.int32, device=DEVICE), lambda: torch.ones(4, 8, dtype=torch.int32, device=DEVICE), TypeError, "dtype"),
        (lambda: randn(8, 4).t(), lambda: randn(8, 4).t(), ValueError, "contiguous"),
        (lambda: randn(4, 8), lambda: [1.0], TypeError, "torch.Tensor"),
    ],
)
def test_swiglu_rejects_bad_input(gate, up, error, message):
    with pytest.raises(error, match=message):
        ops.swiglu(gate(), up())


def test_swiglu_rejects_wrong_device():
    if DEVICE.type == "cuda":
        gate, up = randn(4, 8), torch.randn(4, 8)  # up left on the CPU
        match = "different devices"
    else:
        gate, up = torch.randn(4, 8, device="meta"), torch.randn(4, 8, device="meta")
        match = "kernels run on"
    with pytest.raises(ValueError, match=match):
        ops.swiglu(gate, up)


@pytest.mark.skipif(torch.bfloat16 in DTYPES, reason="bfloat16 is supported here")
def test_swiglu_refuses_bfloat16_where_unsupported():
    # The interpreter (no bfloat16 at all) and GPUs below sm_80 (a T4, or LESSONLIB_GPU_PROFILE=t4).
    gate = torch.randn(2, 4, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(TypeError, match=re.escape(runtime.why_not_bfloat16())):
        ops.swiglu(gate, gate.clone())


@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (3, 5, 33)])
def test_swiglu_gradients_match_float64_autograd(shape, dtype):
    gate, up = randn(*shape, dtype=dtype, scale=3), randn(*shape, dtype=dtype)
    check_gradients("swiglu", ops.swiglu, reference.swiglu, (gate, up), ("gate", "up"), swiglu_grad_magnitudes,
                    swiglu_grad_allowances)


def test_swiglu_gradients_through_strided_halves_of_one_projection(dtype):
    # FusedGatedMLP's case: gate and up are views of one GEMM output, and the gradient must reach that output.
    projection = randn(5, 2 * 45, dtype=dtype).requires_grad_()
    gate, up = projection.chunk(2, dim=-1)
    grad = randn(5, 45, dtype=dtype)
    with poisoned_outputs():
        ops.swiglu(gate, up).backward(grad)
    truth = projection.detach().double().requires_grad_()
    reference.swiglu(*truth.chunk(2, dim=-1)).backward(grad.double())
    low = projection.detach().clone().requires_grad_()
    reference.swiglu(*low.chunk(2, dim=-1)).backward(grad)
    allowances = swiglu_grad_allowances([t.detach() for t in truth.chunk(2, dim=-1)], [grad.double()])
    check_close("swiglu d(projection)", projection.grad, truth.grad, low.grad,
                allowance=max(allowances["gate"], allowances["up"]))


def test_swiglu_without_grad_takes_the_launcher_and_with_grad_the_custom_op():
    gate, up = randn(2, 8), randn(2, 8)
    assert ops.swiglu(gate, up).grad_fn is None
    out = ops.swiglu(gate.requires_grad_(), up)
    assert out.grad_fn is not None and out.requires_grad


@pytest.mark.parametrize("config", [dict(BLOCK=64, num_warps=1), dict(BLOCK=256), dict(num_warps=2)])
def test_swiglu_config_knob_sweeps_tiles_without_changing_the_result(config, dtype):
    # The sweep in benchmarks/bench_fusion.py goes through this knob, never through the private kernel.
    from lessonlib.ops.swiglu import swiglu_forward

    gate, up = randn(5, 300, dtype=dtype, scale=3), randn(5, 300, dtype=dtype)
    with poisoned_outputs():
        out = swiglu_forward(gate, up, config=config)
    check_close("swiglu", out, reference.swiglu(*to_float64(gate, up)), reference.swiglu(gate, up),
                allowance=swiglu_allowance(gate, up))


@pytest.mark.parametrize("config, message", [(dict(BLOCK=100), "power of 2"), (dict(ONE_PASS=True), "unknown")])
def test_swiglu_config_knob_rejects_bad_settings(config, message):
    from lessonlib.ops.swiglu import swiglu_forward

    with pytest.raises(ValueError, match=message):
        swiglu_forward(randn(2, 64), randn(2, 64), config=config)
