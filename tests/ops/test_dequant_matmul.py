"""ops.dequant_matmul against x @ (weight_int8 * scales[:, None]).T in float64: decode and prefill-like odd shapes,
every supported dtype, several programs along both axes and a ragged K, strided rows of x; the errors it raises;
its launch count against the traffic model."""

import importlib

import pytest
import torch

from lessonlib import ops, reference, traffic
from lessonlib.measure import count_launches
from lessonlib.testing import (check_close, dequant_matmul_magnitude, float32_sum_allowance, poisoned_outputs,
                               to_float64)
from tests.conftest import DEVICE, randn

dequant_module = importlib.import_module("lessonlib.ops.dequant_matmul")


def quantised(n, k, dtype):
    """A random (N, K) weight of a linear layer (entries of size k ** -0.5), quantised per row to int8."""
    return reference.quantise_int8(randn(n, k, dtype=dtype, scale=k ** -0.5))


def check_dequant_matmul(x, weight, scales):
    with poisoned_outputs():
        out = ops.dequant_matmul(x, weight, scales)
    x64, s64 = to_float64(x, scales)
    terms = x64[:, None, :] * weight.double()[None] * s64[None, :, None]  # (M, N, K): what each output sums
    check_close("dequant_matmul", out, reference.dequant_matmul(x64, weight, s64),
                reference.dequant_matmul(x, weight, scales), magnitude=dequant_matmul_magnitude(x, weight, scales),
                allowance=float32_sum_allowance(terms))


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 7, 33), (3, 100, 515), (16, 33, 70), (37, 20, 129)])
def test_dequant_matmul_matches_reference(m, n, k, dtype):
    check_dequant_matmul(randn(m, k, dtype=dtype), *quantised(n, k, dtype))


def test_dequant_matmul_with_small_tiles(monkeypatch, dtype):
    """Many programs on both axes, the last ones partly past M and N, and a K loop with a ragged end."""
    monkeypatch.setattr(dequant_module, "config", lambda m, n, k: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4))
    check_dequant_matmul(randn(19, 50, dtype=dtype), *quantised(35, 50, dtype))


def test_dequant_matmul_reads_strided_rows(dtype):
    x = randn(5, 100, dtype=dtype)[:, :40]
    assert x.stride(0) == 100
    check_dequant_matmul(x, *quantised(24, 40, dtype))


def test_quantise_int8_round_trips_within_half_a_scale(dtype):
    weight = randn(33, 70, dtype=dtype)
    weight[3] = 0  # an all-zero row keeps scale 1, not a division by zero
    weight_int8, scales = reference.quantise_int8(weight)
    assert weight_int8.dtype == torch.int8 and scales.dtype == dtype and scales[3] == 1
    assert weight_int8.abs().amax(dim=1)[weight.abs().amax(dim=1) > 0].eq(127).all()  # each row uses the full range
    error = (weight_int8.double() * scales.double()[:, None] - weight.double()).abs()
    assert (error <= scales.double()[:, None] * (0.5 + 127 * torch.finfo(dtype).eps)).all()


def test_dequant_matmul_empty():
    weight, scales = quantised(6, 8, torch.float32)
    assert ops.dequant_matmul(randn(0, 8), weight, scales).shape == (0, 6)


@pytest.mark.parametrize("args, error, message", [
    (lambda: (randn(2, 8), *quantised(6, 9, torch.float32)), ValueError, "K=8 columns but weight_int8 has K=9"),
    (lambda: (randn(8), *quantised(6, 8, torch.float32)), ValueError, r"\(M, K\)"),
    (lambda: (randn(2, 8), quantised(6, 8, torch.float32)[0], randn(5)), ValueError, r"scales must be \(N,\) = \(6,\)"),
    (lambda: (randn(2, 8), quantised(6, 8, torch.float32)[0].float(), randn(6)), TypeError, "must be torch.int8"),
    (lambda: (randn(2, 8), quantised(6, 8, torch.float32)[0], randn(6, dtype=torch.float16)), TypeError, "mixed dtypes"),
    (lambda: (randn(2, 8), quantised(8, 6, torch.float32)[0].t(), randn(6)), ValueError, "weight_int8 must be contiguous"),
    (lambda: (randn(2, 8), [[1] * 8] * 6, randn(6)), TypeError, "weight_int8 must be a torch.Tensor"),
])
def test_dequant_matmul_rejects_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        ops.dequant_matmul(*args())


def test_dequant_matmul_refuses_inputs_that_require_grad():
    weight, scales = quantised(6, 8, torch.float32)
    with pytest.raises(RuntimeError, match="no gradient flows to scales"):
        ops.dequant_matmul(randn(2, 8), weight, scales.requires_grad_())


def test_dequant_matmul_launches_and_bytes_of_the_traffic_model():
    model = traffic.dequant_matmul(3, 20, 40, itemsize=2)
    x, (weight, scales) = randn(3, 40, dtype=torch.float16), quantised(20, 40, torch.float16)
    assert count_launches(reference.dequant_matmul, x, weight, scales).total == model.eager.launches == 3
    assert count_launches(ops.dequant_matmul, x, weight, scales).total == model.fused.launches == 1
    # Both read the int8 weight once; eager also writes the 16-bit weight twice and reads it twice (2 bytes each).
    assert model.eager.bytes - model.fused.bytes == 4 * 2 * 20 * 40
