"""ops.bias_swiglu against silu(gate + gate_bias) * (up + up_bias) in float64: odd shapes, strided halves of one
projection, every supported dtype, outputs poisoned; the errors it raises; its launch count against the traffic
model."""

import re

import pytest
import torch

from lessonlib import ops, reference, runtime, traffic
from lessonlib.measure import count_launches
from lessonlib.testing import check_close, poisoned_outputs, swiglu_allowance, to_float64
from tests.conftest import DEVICE, DTYPES, randn


def check_bias_swiglu(gate, up, gate_bias, up_bias):
    with poisoned_outputs():
        out = ops.bias_swiglu(gate, up, gate_bias, up_bias)
    g64, u64, bg64, bu64 = to_float64(gate, up, gate_bias, up_bias)
    # The float32 sigmoid's share, at the biased inputs the kernel feeds it (testing.swiglu_allowance).
    check_close("bias_swiglu", out, reference.bias_swiglu(g64, u64, bg64, bu64),
                reference.bias_swiglu(gate, up, gate_bias, up_bias), allowance=swiglu_allowance(g64 + bg64, u64 + bu64))


@pytest.mark.parametrize("shape", [(1, 1), (7, 123), (3, 5, 1000), (2, 2049)])
def test_bias_swiglu_matches_reference(shape, dtype):
    gate, up = randn(*shape, dtype=dtype, scale=3), randn(*shape, dtype=dtype)
    check_bias_swiglu(gate, up, randn(shape[-1], dtype=dtype), randn(shape[-1], dtype=dtype))


def test_bias_swiglu_on_strided_halves_of_one_projection(dtype):
    gate, up = randn(9, 2 * 300, dtype=dtype, scale=2).chunk(2, dim=-1)
    assert gate.stride(0) == 600 and not gate.is_contiguous()
    check_bias_swiglu(gate, up, randn(300, dtype=dtype), randn(300, dtype=dtype))


def test_bias_swiglu_empty():
    assert ops.bias_swiglu(randn(0, 8), randn(0, 8), randn(8), randn(8)).shape == (0, 8)


@pytest.mark.parametrize("args, error, message", [
    (lambda: (randn(4, 8), randn(4, 9), randn(8), randn(9)), ValueError, "same shape"),
    (lambda: (randn(4, 8), randn(4, 8), randn(7), randn(8)), ValueError, r"gate_bias must be \(I,\) = \(8,\)"),
    (lambda: (randn(4, 8), randn(4, 8), randn(8), randn(1, 8)), ValueError, r"up_bias must be \(I,\)"),
    (lambda: (randn(4, 8), randn(4, 8), randn(8, dtype=torch.float16), randn(8)), TypeError, "mixed dtypes"),
    (lambda: (randn(8, 4).t(), randn(8, 4).t(), randn(8), randn(8)), ValueError, "contiguous"),
    (lambda: (randn(4, 8), randn(4, 8), [0.0] * 8, randn(8)), TypeError, "torch.Tensor"),
    (lambda: (randn(()), randn(()), randn(1), randn(1)), ValueError, "at least one dimension"),
])
def test_bias_swiglu_rejects_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        ops.bias_swiglu(*args())


@pytest.mark.skipif(torch.bfloat16 in DTYPES, reason="bfloat16 is supported here")
def test_bias_swiglu_refuses_bfloat16_where_unsupported():
    gate = torch.randn(2, 4, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(TypeError, match=re.escape(runtime.why_not_bfloat16())):
        ops.bias_swiglu(gate, gate.clone(), gate[0].clone(), gate[0].clone())


def test_bias_swiglu_refuses_inputs_that_require_grad():
    gate_bias = randn(8).requires_grad_()
    with pytest.raises(RuntimeError, match="no gradient flows to gate_bias"):
        ops.bias_swiglu(randn(2, 8), randn(2, 8), gate_bias, randn(8))


def test_bias_swiglu_launches_what_the_traffic_model_counts():
    model = traffic.bias_swiglu(3, 40, itemsize=4)
    args = (randn(3, 40), randn(3, 40), randn(40), randn(40))
    assert count_launches(reference.bias_swiglu, *args).total == model.eager.launches == 4
    assert count_launches(ops.bias_swiglu, *args).total == model.fused.launches == 1
    assert model.eager.bytes - model.fused.bytes == 6 * 3 * 40 * 4  # three (T, I) temporaries, each written and read
