import pytest
import torch

from lessonlib import ops, reference
from lessonlib.ops.flash_attention import flash_attention_dtypes
from lessonlib.testing import attention_allowance, check_close, poisoned_outputs, to_float64
from tests.conftest import DEVICE, randn


def prefill_inputs(seq_lens, new_tokens, heads, kv_heads, head_dim, block_size, dtype):
    """Sequences whose last ``new_tokens[b]`` tokens are being prefilled over a cached prefix, in a pool whose
    blocks are handed out in shuffled order; block tables padded with -1."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(sum(new_tokens), heads, head_dim, dtype=dtype)
    return (q, k_cache, v_cache, table.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            starts.to(DEVICE))


def check(q, k_cache, v_cache, table, lens, starts):
    max_new = int((starts[1:] - starts[:-1]).max())
    with poisoned_outputs():
        out = ops.paged_prefill_attention(q, k_cache, v_cache, table, lens, starts, max_new)
    truth = reference.paged_prefill_attention(*to_float64(q, k_cache, v_cache), table, lens, starts)
    low = reference.paged_prefill_attention(q, k_cache, v_cache, table, lens, starts)
    check_close("paged_prefill_attention", out, truth, low, allowance=attention_allowance(q, k_cache, v_cache))


@pytest.mark.parametrize(
    "seq_lens, new_tokens, heads, kv_heads, head_dim, block_size",
    [([1], [1], 2, 2, 16, 16),  # a one-token prompt, nothing cached
     ([37, 16, 7], [5, 16, 7], 4, 2, 32, 16),  # a cached prefix of 32; a whole 16-token prompt; a prompt of 7
     ([50, 33], [1, 33], 8, 1, 64, 32),  # one new token after a long prefix (a decode step, written as prefill)
     ([123], [91], 4, 4, 16, 16)],  # several query tiles, the first tiles seeing part of the cached prefix
)
def test_paged_prefill_attention_matches_reference(seq_lens, new_tokens, heads, kv_heads, head_dim, block_size, dtype):
    check(*prefill_inputs(seq_lens, new_tokens, heads, kv_heads, head_dim, block_size, dtype))


def test_no_cached_prefix_is_flash_attention(dtype):
    if dtype not in flash_attention_dtypes():
        pytest.skip(f"flash_attention takes no {dtype} here (a GPU runs float32 products as TF32)")
    # With nothing cached, paged prefill is ordinary causal attention: the same as flash_attention on the gathered K/V.
    q, k_cache, v_cache, table, lens, starts = prefill_inputs([29], [29], 4, 2, 32, 16, dtype)
    out = ops.paged_prefill_attention(q, k_cache, v_cache, table, lens, starts, 29)
    blocks = table[0, :2].long()
    k = k_cache[blocks].reshape(-1, 2, 32)[:29].transpose(0, 1)[None]
    v = v_cache[blocks].reshape(-1, 2, 32)[:29].transpose(0, 1)[None]
    flash = ops.flash_attention(q.transpose(0, 1)[None], k, v, causal=True)[0].transpose(0, 1)
    truth = reference.paged_prefill_attention(*to_float64(q, k_cache, v_cache), table, lens, starts)
    low = reference.paged_prefill_attention(q, k_cache, v_cache, table, lens, starts)
    allowance = attention_allowance(q, k_cache, v_cache)
    check_close("flash_attention", flash, truth, low, allowance=allowance)
    check_close("paged_prefill_attention", out, truth, low, allowance=allowance)


def good():
    return list(prefill_inputs([20, 5], [4, 5], 4, 2, 32, 16, torch.float32)) + [5]


BAD_INPUTS = {
    "starts not covering q": (lambda a: a.__setitem__(5, torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)), ValueError, "rise from 0"),
    "more new tokens than max_query_len": (lambda a: a.__setitem__(6, 4), ValueError, "max_query_len"),
    "seq_len shorter than its new tokens": (lambda a: a.__setitem__(4, torch.tensor([20, 3], dtype=torch.int32, device=DEVICE)), ValueError, "shorter"),
    "int64 starts": (lambda a: a.__setitem__(5, a[5].long()), TypeError, "int32"),
    "starts of the wrong length": (lambda a: a.__setitem__(5, a[5][:2]), TypeError, "3 rows"),
    "2-D q": (lambda a: a.__setitem__(0, randn(9, 128)), ValueError, r"\(T, H, D\)"),
    "3 heads over 2 KV heads": (lambda a: a.__setitem__(0, randn(9, 3, 32)), ValueError, "multiple of"),
    "table outside the pool": (lambda a: a[3].__setitem__((0, 0), 10**6), ValueError, "outside the pool"),
    "float16 q, float32 cache": (lambda a: a.__setitem__(0, a[0].half()), TypeError, "mixed dtypes"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_paged_prefill_attention_rejects_bad_input(case):
    spoil, error, message = BAD_INPUTS[case]
    args = good()
    spoil(args)
    with pytest.raises(error, match=message):
        ops.paged_prefill_attention(*args)
