import pytest
import torch

from lessonlib import ops, reference
from lessonlib.kv_cache import PagedKVCache
from lessonlib.testing import attention_allowance, check_close, poisoned_outputs, to_float64
from tests.conftest import DEVICE, randn


def paged_inputs(seq_lens, heads, kv_heads, head_dim, block_size, dtype, spare_blocks=3):
    """A pool whose physical blocks are handed out in shuffled order, and block tables padded with -1."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    q = randn(len(seq_lens), heads, head_dim, dtype=dtype)
    return q, k_cache, v_cache, table.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def check(q, k_cache, v_cache, table, lens, **kwargs):
    with poisoned_outputs():
        out = ops.paged_attention(q, k_cache, v_cache, table, lens, **kwargs)
    truth = reference.paged_attention(*to_float64(q, k_cache, v_cache), table, lens)
    check_close("paged_attention", out, truth, reference.paged_attention(q, k_cache, v_cache, table, lens),
                allowance=attention_allowance(q, k_cache, v_cache, kwargs.get("sm_scale")))


@pytest.mark.parametrize(
    "seq_lens, heads, kv_heads, head_dim, block_size",
    [([1], 4, 4, 32, 16), ([16, 1, 33], 8, 2, 64, 16), ([64, 5], 8, 1, 32, 32), ([100, 17, 32, 1], 16, 2, 16, 16),
     ([47], 32, 8, 128, 16)],
)
def test_paged_attention_matches_reference(seq_lens, heads, kv_heads, head_dim, block_size, dtype):
    check(*paged_inputs(seq_lens, heads, kv_heads, head_dim, block_size, dtype))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("blocks_per_step", [1, 2, None])
def test_every_split_and_step_gives_the_same_attention(num_splits, blocks_per_step, dtype):
    # 7 splits over 8 blocks: some splits are empty for the shorter sequences and must weigh nothing; several
    # blocks per step leave partial steps at the end of a split.
    check(*paged_inputs([128, 20, 1], 8, 2, 32, 16, dtype), num_splits=num_splits, blocks_per_step=blocks_per_step)


def test_slots_past_each_sequence_are_never_read(dtype):
    """The last block of each sequence is filled past its length with NaN (what a freed sequence's block may hold
    after an overflow): the output must not change, since no query may see those slots."""
    q, k_cache, v_cache, table, lens = paged_inputs([16, 1, 33, 7], 8, 2, 32, 16, dtype)
    for b, n in enumerate(lens.tolist()):
        last = int(table[b, (n - 1) // 16])
        k_cache[last, (n - 1) % 16 + 1:] = float("nan")
        v_cache[last, (n - 1) % 16 + 1:] = float("nan")
    check(q, k_cache, v_cache, table, lens, num_splits=2)


def test_paged_attention_through_a_paged_kv_cache(dtype):
    cache = PagedKVCache(num_blocks=10, block_size=16, num_kv_heads=2, head_dim=32, dtype=dtype, device=DEVICE)
    for seq, n in (("a", 40), ("b", 16), ("c", 3)):
        cache.add_sequence(seq)
        cache.append(seq, randn(n, 2, 32, dtype=dtype), randn(n, 2, 32, dtype=dtype))
    cache.fork("b", "b2")
    cache.append("b2", randn(1, 2, 32, dtype=dtype), randn(1, 2, 32, dtype=dtype))
    seqs = ["a", "b", "b2", "c"]
    q = randn(len(seqs), 8, 32, dtype=dtype)
    table, lens = cache.block_table(seqs), cache.seq_lens(seqs)
    check(q, cache.k_cache, cache.v_cache, table, lens)
    # And the gathered pages equal what was appended: attention over read() with a trivial table agrees.
    k, v = cache.read("a")
    contiguous = reference.paged_attention(q[:1], k[None], v[None], torch.zeros(1, 1, dtype=torch.int32), lens[:1])
    torch.testing.assert_close(reference.paged_attention(q, cache.k_cache, cache.v_cache, table, lens)[:1], contiguous)


def good():
    """q, k_cache, v_cache, block_table, seq_lens: valid, ready to spoil one at a time."""
    return list(paged_inputs([20, 5], 4, 2, 32, 16, torch.float32))


def table_points_outside(args):
    args[3] = args[3].clone()
    args[3][0, 1] = args[1].shape[0]  # one past the last block, in a block the sequence uses


def padding_points_outside_is_fine(args):
    args[3] = args[3].clone()
    args[3][1, -1] = 10**6  # past seq_len: never read


BAD_INPUTS = {
    "table outside the pool": (table_points_outside, ValueError, "outside the pool"),
    "seq_len beyond the table": (lambda a: a.__setitem__(4, torch.tensor([20, 100], dtype=torch.int32, device=DEVICE)), ValueError, "capacity"),
    "empty sequence": (lambda a: a.__setitem__(4, torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)), ValueError, ">= 1"),
    "int64 table": (lambda a: a.__setitem__(3, a[3].long()), TypeError, "int32"),
    "3 heads over 2 KV heads": (lambda a: a.__setitem__(0, randn(2, 3, 32)), ValueError, "multiple of"),
    "head_dim 48": (lambda a: a.__setitem__(0, randn(2, 4, 48)), ValueError, "head_dim"),
    "float16 q, float32 cache": (lambda a: a.__setitem__(0, a[0].half()), TypeError, "mixed dtypes"),
    "4-D q": (lambda a: a.__setitem__(0, randn(2, 4, 2, 32)), ValueError, r"\(B, H, D\)"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_paged_attention_rejects_bad_input(case):
    spoil, error, message = BAD_INPUTS[case]
    args = good()
    spoil(args)
    with pytest.raises(error, match=message):
        ops.paged_attention(*args)


def test_padding_beyond_seq_len_is_not_validated():
    args = good()
    padding_points_outside_is_fine(args)
    check(*args)


@pytest.mark.parametrize("block_size", [8, 48])
def test_paged_attention_rejects_unsupported_block_sizes(block_size):
    q, k_cache, v_cache, table, lens = paged_inputs([5], 4, 2, 32, block_size, torch.float32)
    with pytest.raises(ValueError, match="power of two, at least 16"):
        ops.paged_attention(q, k_cache, v_cache, table, lens)


def test_paged_attention_rejects_blocks_per_step_not_a_power_of_two():
    with pytest.raises(ValueError, match="blocks_per_step"):
        ops.paged_attention(*good(), blocks_per_step=3)


def test_validate_false_skips_only_the_table_checks():
    args = good()
    torch.testing.assert_close(ops.paged_attention(*args, validate=False), ops.paged_attention(*args), rtol=0, atol=0)
    with pytest.raises(ValueError, match="head_dim"):  # shapes are still checked
        ops.paged_attention(args[0][..., :16], *args[1:], validate=False)


def test_paged_attention_refuses_inputs_that_require_grad_outside_no_grad():
    cache = PagedKVCache(num_blocks=2, block_size=16, num_kv_heads=1, head_dim=16, dtype=torch.float32, device=DEVICE)
    cache.add_sequence("a")
    cache.append("a", randn(5, 1, 16), randn(5, 1, 16))
    q = randn(1, 2, 16).requires_grad_()
    args = (cache.k_cache, cache.v_cache, cache.block_table(["a"]), cache.seq_lens(["a"]))
    with pytest.raises(RuntimeError, match="paged_attention: no gradient flows to q"):
        ops.paged_attention(q, *args)
    with torch.no_grad():
        out = ops.paged_attention(q, *args)
    check_close("paged_attention under no_grad", out, reference.paged_attention(*to_float64(q, *args[:2]), *args[2:]),
                reference.paged_attention(q.detach(), *args), allowance=attention_allowance(q, *args[:2]))
