"""The decode step of lesson 05: lessonlib's kernels against plain PyTorch, over a paged cache."""

import copy

import pytest
import torch

from lessonlib.decoder import DecoderLayer, next_token_inputs
from lessonlib.kv_cache import OutOfBlocks, PagedKVCache
from lessonlib.testing import check_close, gated_mlp_magnitude, rms_statistic_units
from tests.conftest import DEVICE, randn


def test_fused_decode_step_matches_the_reference(dtype):
    layer = DecoderLayer(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, device=DEVICE, dtype=dtype)
    cache = PagedKVCache(num_blocks=12, block_size=16, num_kv_heads=2, head_dim=16, dtype=dtype, device=DEVICE)
    seqs = {"a": 15, "b": 16, "c": 40}  # the next token opens a new block for b, stays in one for a and c
    for seq, n in seqs.items():
        cache.add_sequence(seq)
        cache.append(seq, randn(n, 2, 16, dtype=dtype), randn(n, 2, 16, dtype=dtype))
    hidden, residual = randn(3, 64, dtype=dtype), randn(3, 64, dtype=dtype)
    inputs = next_token_inputs(cache, list(seqs), hidden, residual, max_blocks=6)
    assert inputs.block_table.shape == (3, 6) and inputs.seq_lens.tolist() == [16, 17, 41]

    truth_layer = copy.deepcopy(layer).double()
    truth_inputs = copy.deepcopy(inputs)
    for name in ("hidden", "residual", "cos", "sin"):
        setattr(truth_inputs, name, getattr(inputs, name).double())
    truth_k, truth_v = cache.k_cache.double(), cache.v_cache.double()
    kept = {}
    hook = truth_layer.mlp.register_forward_hook(lambda m, i, o: kept.update(x=i[0]))
    truth, truth_residual = truth_layer.step(truth_inputs, truth_k, truth_v)
    hook.remove()
    low_k, low_v = cache.k_cache.clone(), cache.v_cache.clone()
    low, low_residual = layer.step(inputs, low_k, low_v)

    with torch.no_grad():
        out, out_residual = layer.fused_step(inputs, cache.k_cache, cache.v_cache)
    # The step's output is the MLP's: a sum that cancels (testing.gated_mlp_magnitude). Both fused add_rms_norms'
    # rstd offsets (testing.rms_statistic_units each, float32, draws of their own) move the MLP's input by at most
    # their sum, relative (the first through attention, a convex combination, and o_proj, the second directly);
    # scaling gate and up by (1 + d) moves act = silu(gate) * up by at most d (2 |act| + 0.44 |up|)
    # (g silu'(g) = silu(g) + g^2 s (1 - s), the last at most 0.44). (With the terms alone: 0.43 of the float32
    # tolerance in 5 draws.)
    mlp = truth_layer.mlp
    with torch.no_grad():
        up = mlp.up_proj(kept["x"])
        act = (torch.nn.functional.silu(mlp.gate_proj(kept["x"])) * up).abs()
        up = up.abs()
        moved = ((2 * act + 0.44 * up) @ mlp.down_proj.weight.abs().T).max().item()
    terms = gated_mlp_magnitude(mlp, kept["x"])
    offsets = 2 * rms_statistic_units(64) * torch.finfo(torch.float32).eps
    check_close("decode step", out, truth.detach(), low.detach(), terms, allowance=offsets * moved)
    check_close("decode step residual", out_residual, truth_residual.detach(), low_residual.detach())
    # The new K is rope(W_k @ normed): the fused add_rms_norm's rstd offset (testing.rms_statistic_units, a draw of
    # its own) scales normed, so it scales K and its rotation by the same factor: an allowance relative to max|K|.
    truth_new_k = truth_k.view(-1, 2, 16)[inputs.slots]
    statistic = rms_statistic_units(64) * torch.finfo(torch.float32).eps * truth_new_k.abs().max().item()
    check_close("new K in the cache", cache.k_cache.view(-1, 2, 16)[inputs.slots], truth_new_k,
                low_k.view(-1, 2, 16)[inputs.slots], allowance=statistic)


def test_next_token_inputs_refuses_a_table_wider_than_max_blocks_and_changes_nothing():
    cache = PagedKVCache(num_blocks=8, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32, device=DEVICE)
    cache.add_sequence("a")
    cache.append("a", randn(32, 2, 16), randn(32, 2, 16))
    with pytest.raises(ValueError, match="max_blocks"):
        next_token_inputs(cache, ["a"], randn(1, 64), randn(1, 64), max_blocks=2)
    assert cache.lengths["a"] == 32 and len(cache.tables["a"]) == 2  # nothing reserved


def test_next_token_inputs_out_of_blocks_changes_nothing():
    cache = PagedKVCache(num_blocks=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32, device=DEVICE)
    for seq in ("a", "b"):
        cache.add_sequence(seq)
        cache.append(seq, randn(16, 2, 16), randn(16, 2, 16))
    with pytest.raises(OutOfBlocks):
        next_token_inputs(cache, ["a", "b"], randn(2, 64), randn(2, 64), max_blocks=4)
    assert cache.lengths == {"a": 16, "b": 16} and cache.allocator.num_free == 0
