"""ops.absmax_normalize, both strategies (two launches: the launch boundary is the barrier; one program: no barrier
needed) against x / max|x| in float64: sizes within one block, across many programs, past MAX_PARTIALS programs
(the reduction's grid-stride loop); an all-zero x; the errors it raises; launches and bytes of the traffic model."""

import importlib

import pytest
import torch

from lessonlib import ops, reference, traffic
from lessonlib.measure import count_launches
from lessonlib.testing import check_close, poisoned_outputs, to_float64
from tests.conftest import DEVICE, randn

module = importlib.import_module("lessonlib.ops.absmax_normalize")


def check_absmax_normalize(x, strategy):
    with poisoned_outputs():
        out = ops.absmax_normalize(x, strategy)
    check_close(f"absmax_normalize ({strategy})", out, reference.absmax_normalize(*to_float64(x)),
                reference.absmax_normalize(x))


@pytest.mark.parametrize("strategy", ["two_launches", "one_program"])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 333), (10007,)])
def test_absmax_normalize_matches_reference(shape, strategy, dtype):
    x = randn(*shape, dtype=dtype, scale=5)
    x.view(-1)[torch.randint(x.numel(), ())] = -100.0  # the maximum's place drawn anew: any program may hold it
    check_absmax_normalize(x, strategy)


def test_two_launches_with_fewer_programs_than_blocks(monkeypatch, dtype):
    """More blocks than the reduction's programs: each program walks several (its grid-stride loop), and the
    maximum may sit in a block a program reaches on a later step."""
    monkeypatch.setattr(module, "BLOCK", 64)
    monkeypatch.setattr(module, "MAX_PARTIALS", 3)
    assert module.partial_programs(1000) == 3
    x = randn(1000, dtype=dtype)
    x[torch.randint(64 * 3, 1000, ())] = 50.0  # past the first step of every program
    check_absmax_normalize(x, "two_launches")


@pytest.mark.parametrize("strategy", ["two_launches", "one_program"])
def test_absmax_normalize_leaves_zeros_alone(strategy):
    zeros = torch.zeros(9, device=DEVICE)
    assert torch.equal(ops.absmax_normalize(zeros, strategy), zeros)


def test_absmax_normalize_empty():
    assert ops.absmax_normalize(randn(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("args, error, message", [
    (lambda: (randn(8), "grid_barrier"), ValueError, "strategy must be one of"),
    (lambda: (randn(8, 4).t(),), ValueError, "contiguous"),
    (lambda: (randn(4, 8)[:, ::2],), ValueError, "contiguous"),
    (lambda: (torch.ones(8, dtype=torch.int32, device=DEVICE),), TypeError, "dtype"),
    (lambda: ([1.0, 2.0],), TypeError, "torch.Tensor"),
])
def test_absmax_normalize_rejects_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        ops.absmax_normalize(*args())


def test_absmax_normalize_launches_and_bytes_of_the_traffic_model():
    x = randn(5000)
    programs = module.partial_programs(5000)
    two, one = (traffic.absmax_normalize(5000, 4, programs, strategy) for strategy in ("two_launches", "one_program"))
    assert count_launches(reference.absmax_normalize, x).total == two.eager.launches == 6
    assert count_launches(ops.absmax_normalize, x, "two_launches").total == two.fused.launches == 2
    assert count_launches(ops.absmax_normalize, x, "one_program").total == one.fused.launches == 1
    # Both read x twice and write it once: the barrier costs the two-launch version a launch and its partials.
    assert two.fused.bytes - one.fused.bytes == 2 * programs * 4
