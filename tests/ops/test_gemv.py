"""ops.gemv against F.linear (and F.linear then swiglu) in float64: one token's linear layer, with and without a
bias and SwiGLU in the epilogue, odd shapes, strided rows, several programs and K tiles; the errors it raises; on a
GPU, a chain of dependent products in a CUDA graph (with programmatic dependent launch on Hopper: a missing wait
would read the previous product before it is written)."""

import importlib
import os

import pytest
import torch

from lessonlib import ops, reference, runtime
from lessonlib.ops._common import gdc_wait, pdl
from lessonlib.testing import check_close, poisoned_outputs, to_float64
from tests.conftest import DEVICE, randn

gemv_module = importlib.import_module("lessonlib.ops.gemv")


def magnitude(x, weight, bias, activation):
    """The sum of |terms| of each output, its largest: a float32 accumulation's roundings are relative to it, not
    to the (possibly cancelling) result. SwiGLU: silu(g) * u is bounded by |g| |u|."""
    terms = x.double().abs() @ weight.double().abs().T + (bias.double().abs() if bias is not None else 0)
    if activation == "swiglu":
        gate, up = terms.chunk(2, dim=-1)
        terms = gate * up
    return terms.max().item() if terms.numel() else 0.0


def check_gemv(x, weight, bias=None, activation=None):
    with poisoned_outputs():
        out = ops.gemv(x, weight, bias, activation=activation)
    check_output(out, x, weight, bias, activation)


def check_output(out, x, weight, bias=None, activation=None):
    f64 = to_float64(x, weight, *([bias] if bias is not None else []))
    truth = reference.gemv(f64[0], f64[1], f64[2] if bias is not None else None, activation)
    check_close("gemv", out, truth, reference.gemv(x, weight, bias, activation),
                magnitude=magnitude(x, weight, bias, activation))


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 7, 33), (1, 300, 515), (2, 96, 64), (3, 10, 2049)])
@pytest.mark.parametrize("activation", [None, "swiglu"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no bias", "bias"])
def test_gemv_matches_linear(m, n, k, activation, with_bias, dtype):
    n = 2 * n if activation == "swiglu" else n
    x, weight = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype, scale=k ** -0.5)
    check_gemv(x, weight, randn(n, dtype=dtype) if with_bias else None, activation)


@pytest.mark.parametrize("block_k", [16, 64], ids=["K in tiles", "K tiles past the end"])
@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_gemv_with_the_gpus_small_tiles(monkeypatch, block_k, activation, dtype):
    """The GPU's configuration (a few columns per program, K in tiles) at interpreter sizes: many programs, the
    last one partly past N, and a K loop with (K=50) and without (K=64) a ragged end."""
    monkeypatch.setattr(gemv_module, "config", lambda n_out, k, swiglu: {"BLOCK_N": 4, "BLOCK_K": block_k, "num_warps": 4})
    for m, k in ((1, 50), (1, 64), (3, 50)):  # three rows: the grid's second axis
        x, weight = randn(m, k, dtype=dtype), randn(2 * 11, k, dtype=dtype, scale=k ** -0.5)
        check_gemv(x, weight, randn(2 * 11, dtype=dtype), activation)


def test_gemv_reads_strided_rows(dtype):
    """x one row of a wider buffer; weight the first K columns of a wider matrix (rows stride_wn apart)."""
    x = randn(3, 100, dtype=dtype)[1:2, :40]
    weight = randn(30, 72, dtype=dtype, scale=0.2)[:, :40]
    assert x.stride(0) == 100 and weight.stride(0) == 72
    check_gemv(x, weight)
    check_gemv(x, weight, activation="swiglu")


def test_gemv_empty():
    assert ops.gemv(randn(0, 8), randn(6, 8)).shape == (0, 6)
    assert ops.gemv(randn(0, 8), randn(6, 8), activation="swiglu").shape == (0, 3)


@pytest.mark.parametrize("args, kwargs, error, message", [
    (lambda: (randn(1, 8), randn(6, 9)), {}, ValueError, "K=8 columns but weight has K=9"),
    (lambda: (randn(8), randn(6, 8)), {}, ValueError, r"\(M, K\)"),
    (lambda: (randn(1, 8), randn(5, 8)), {"activation": "swiglu"}, ValueError, "even N"),
    (lambda: (randn(1, 8), randn(6, 8)), {"activation": "gelu"}, ValueError, "activation must be one of"),
    (lambda: (randn(1, 8), randn(6, 8), randn(5)), {}, ValueError, r"bias must be \(N,\)"),
    (lambda: (randn(1, 8), randn(6, 8, dtype=torch.float16)), {}, TypeError, "mixed dtypes"),
    (lambda: (randn(1, 8), randn(8, 6).t()), {}, ValueError, "contiguous"),
    (lambda: (randn(1, 0), randn(6, 0)), {}, ValueError, "K must be at least 1"),
    (lambda: (randn(65536, 1), randn(2, 1)), {}, ValueError, "at most 65535"),
])
def test_gemv_rejects_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        ops.gemv(*args(), **kwargs)


def test_gemv_refuses_inputs_that_require_grad_outside_no_grad():
    x, weight = randn(1, 8), randn(6, 8).requires_grad_()
    with pytest.raises(RuntimeError, match="no gradient flows to weight"):
        ops.gemv(x, weight)
    with torch.no_grad():
        check_gemv(x, weight.detach())


def test_pdl_only_on_hopper_and_newer(monkeypatch):
    profile = runtime.gpu_profile()
    hopper = profile is not None and profile.capability >= (9, 0)  # an emulated T4 on an H200: no PDL
    assert pdl() == (hopper and gdc_wait is not None and os.environ.get("LESSONLIB_PDL", "1").strip() != "0")
    monkeypatch.setenv("LESSONLIB_PDL", "0")
    assert pdl.__wrapped__() is False  # switched off by the environment, wherever it runs


def chain_of_products(width: int, dtype):
    """Eight dependent products, each reading the one before: plain (width, width) and SwiGLU (2 width, width) in
    turn, so every output is `width` wide."""
    return [randn(2 * width if i % 2 else width, width, dtype=dtype, scale=width ** -0.5) for i in range(8)]


def run_chain(x, weights):
    """Every product's output, in order (the last is the chain's)."""
    outs = []
    for i, w in enumerate(weights):
        outs.append(ops.gemv(outs[-1] if outs else x, w, activation="swiglu" if i % 2 else None))
    return outs


def check_chain(outs, x, weights):
    """Each product against float64 on the input it was given (the previous product's output as written), so a
    product that read a stale or half-written x fails, whatever the chain's accumulated rounding."""
    for i, (out, inp, w) in enumerate(zip(outs, [x, *outs[:-1]], weights)):
        check_output(out, inp, w, None, "swiglu" if i % 2 else None)


def test_a_chain_of_products(dtype):
    weights = chain_of_products(64, dtype)
    x = randn(1, 64, dtype=dtype)
    with poisoned_outputs():
        outs = run_chain(x, weights)
    check_chain(outs, x, weights)


@pytest.mark.skipif(not runtime.on_gpu(), reason="CUDA graphs need a GPU")
def test_a_chain_of_products_in_a_cuda_graph():
    """The chain captured in one graph and replayed on fresh inputs each time. Back to back in a graph, with PDL on
    Hopper, each product starts before the previous one ends: a product that read its x before its wait would read
    the previous replay's intermediate, computed from other inputs, and fail its check."""
    dtype = runtime.supported_dtypes()[-1]
    weights = chain_of_products(2048, dtype)
    x = randn(1, 2048, dtype=dtype)
    run_chain(x, weights)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run_chain(x, weights)  # kept: the graph writes these tensors at every replay
    for _ in range(3):
        x.copy_(randn(1, 2048, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        check_chain(outs, x, weights)
