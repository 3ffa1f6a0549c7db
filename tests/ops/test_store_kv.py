import pytest
import torch

from lessonlib import ops
from tests.conftest import DEVICE, randn


def pool(num_blocks=6, block_size=4, heads=2, dim=8, dtype=torch.float32):
    return (torch.full((num_blocks, block_size, heads, dim), float("nan"), dtype=dtype, device=DEVICE),
            torch.full((num_blocks, block_size, heads, dim), float("nan"), dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("validate", [True, False])
def test_store_kv_writes_exactly_the_given_slots(dtype, validate):
    k_cache, v_cache = pool(dtype=dtype)
    k, v = randn(7, 2, 8, dtype=dtype), randn(7, 2, 8, dtype=dtype)
    slots = torch.randperm(24, device=DEVICE)[:7]
    ops.store_kv(k, v, k_cache, v_cache, slots, validate=validate)
    flat_k, flat_v = k_cache.reshape(24, 2, 8), v_cache.reshape(24, 2, 8)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(24, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_store_kv_strided_tokens():
    k_cache, v_cache = pool()
    k = randn(5, 2, 16)[:, :, :8]  # a token's row is not contiguous: rejected
    with pytest.raises(ValueError, match="contiguous"):
        ops.store_kv(k, k, k_cache, v_cache, torch.arange(5, device=DEVICE))
    k = randn(10, 2, 8)[::2]  # tokens two rows apart, each row contiguous: fine
    ops.store_kv(k, k, k_cache, v_cache, torch.arange(5, device=DEVICE))
    assert torch.equal(k_cache.reshape(24, 2, 8)[:5], k)


@pytest.mark.parametrize(
    "slots, message",
    [([0, 1, 24], r"\[0, 24\)"), ([0, -1, 2], r"\[0, 24\)"), ([3, 3, 4], "same slot")],
)
def test_store_kv_rejects_bad_slots_and_writes_nothing(slots, message):
    k_cache, v_cache = pool()
    with pytest.raises(ValueError, match=message):
        ops.store_kv(randn(3, 2, 8), randn(3, 2, 8), k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


def test_store_kv_rejects_mismatched_shapes():
    k_cache, v_cache = pool()
    with pytest.raises(ValueError, match="caches must be"):
        ops.store_kv(randn(3, 2, 4), randn(3, 2, 4), k_cache, v_cache, torch.arange(3, device=DEVICE))
    with pytest.raises(TypeError, match="slots"):
        ops.store_kv(randn(3, 2, 8), randn(3, 2, 8), k_cache, v_cache, torch.arange(3, device=DEVICE).float())


def test_store_kv_refuses_inputs_that_require_grad_outside_no_grad():
    # The cache is a constant to attention: a k that requires grad would lose its gradient silently.
    k_cache, v_cache = pool()
    k, v = randn(2, 2, 8).requires_grad_(), randn(2, 2, 8)
    slots = torch.tensor([0, 5], device=DEVICE)
    with pytest.raises(RuntimeError, match="store_kv: no gradient flows to k"):
        ops.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.isnan(k_cache).all()  # refused before the launch
    with torch.no_grad():
        ops.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 8)[slots], k.detach())
