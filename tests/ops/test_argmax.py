"""ops.argmax against torch.argmax: the same index exactly (an argmax has no rounding), ties included."""

import importlib
import random

import pytest
import torch

from lessonlib import ops
from tests.conftest import DEVICE, randn

argmax_module = importlib.import_module("lessonlib.ops.argmax")  # the module (ops.argmax is the function)


@pytest.fixture(params=[1, 3], ids=["one chunk", "three chunks"])
def chunks(request, monkeypatch):
    """One chunk per row is the interpreter's choice; three forces the second pass (the GPU's path)."""
    monkeypatch.setattr(argmax_module, "num_chunks", lambda rows, n_cols: request.param)
    return request.param


@pytest.mark.parametrize("rows, n", [(1, 1), (1, 1000), (3, 1025), (5, 3333), (2, 4099)])
def test_argmax_matches_torch(dtype, chunks, rows, n):
    x = randn(rows, n, dtype=dtype)
    assert torch.equal(ops.argmax(x), torch.argmax(x, dim=-1))


def test_ties_go_to_the_first_index(chunks):
    """The maximum planted at several places: inside one tile, across tiles of one chunk, across chunks."""
    x = randn(4, 3 * argmax_module.BLOCK + 5, dtype=torch.float32)
    top = x.max() + 1
    for row, places in enumerate([(7, 9), (100, argmax_module.BLOCK + 3), (2 * argmax_module.BLOCK + 1, 3000),
                                  (x.shape[1] - 1, x.shape[1] - 2)]):
        for place in places:
            x[row, place] = top
    assert ops.argmax(x).tolist() == [7, 100, 2 * argmax_module.BLOCK + 1, x.shape[1] - 2]
    assert torch.equal(ops.argmax(x), torch.argmax(x, dim=-1))


def test_rows_of_minus_infinity_and_strided_rows(chunks):
    x = randn(6, 2 * argmax_module.BLOCK + 7, dtype=torch.float32)
    x[1] = float("-inf")  # every value equal: index 0, as torch.argmax
    x[2, :-1] = float("-inf")  # the last column alone is finite
    rows = x[::2]  # rows two apart: the kernel reads each with its stride
    assert torch.equal(ops.argmax(x), torch.argmax(x, dim=-1))
    assert torch.equal(ops.argmax(rows), torch.argmax(rows, dim=-1))


def test_num_chunks_fills_the_gpu_and_never_makes_an_empty_chunk():
    block = argmax_module.BLOCK
    assert argmax_module.num_chunks(1, 128256, multiprocessors=132) == -(-128256 // block)  # one tile each
    assert argmax_module.num_chunks(1, 1 << 20, multiprocessors=132) == 2 * 132
    assert argmax_module.num_chunks(64, 128256, multiprocessors=132) == 4
    assert argmax_module.num_chunks(1, 100, multiprocessors=132) == 1  # shorter than one tile


@pytest.mark.parametrize("bad, error, message", [
    (lambda: randn(4, dtype=torch.float32), ValueError, r"\(rows, n\)"),
    (lambda: randn(2, 0, dtype=torch.float32), ValueError, r"\(rows, n\)"),
    (lambda: randn(3, 8, dtype=torch.float32)[:, ::2], ValueError, "contiguous"),
    (lambda: torch.zeros(2, 5, dtype=torch.int32, device=DEVICE), TypeError, "dtype"),
])
def test_bad_input_is_refused(bad, error, message):
    with pytest.raises(error, match=message):
        ops.argmax(bad())


@pytest.mark.parametrize("sentinel", [-2, 7, 2**40])
def test_rows_holding_nan_or_infinity_get_the_nonfinite_index(dtype, chunks, sentinel):
    """With ``nonfinite``, a row holding NaN, +inf or -inf anywhere (any chunk, any tile) gets that index; a finite
    row its argmax, as without it; the padding past a row's end is not mistaken for a value."""
    rows, n = 7, 2 * argmax_module.BLOCK + random.randrange(1, argmax_module.BLOCK)
    x = randn(rows, n, dtype=dtype)
    bad = random.sample(range(rows), 4)
    for row, value in zip(bad, [float("nan"), float("inf"), float("-inf"), float("nan")]):
        x[row, random.randrange(n)] = value
    x[bad[3]] = float("-inf")  # a row of -inf only: no finite value at all
    x[bad[3], random.randrange(n)] = float("nan")
    expected = torch.where(torch.isfinite(x).all(dim=-1), torch.argmax(x, dim=-1), sentinel)
    assert torch.equal(ops.argmax(x, nonfinite=sentinel), expected)
    assert torch.equal(ops.argmax(x[::2], nonfinite=sentinel), expected[::2])  # strided rows


@pytest.mark.parametrize("nonfinite", [True, 1.0, "-2", 2**63])
def test_a_nonfinite_index_that_is_not_an_int64_is_refused(nonfinite):
    with pytest.raises(TypeError, match="nonfinite"):
        ops.argmax(randn(2, 5, dtype=torch.float32), nonfinite=nonfinite)
