"""PagedKVCache under random sequences of add / append / fork / free (hypothesis), with every invariant checked
after every step, plus the errors that must leave the cache exactly as it was.

Keys and values are a deterministic function of the token prefix they belong to, as in a real model (position i's
K/V depend on tokens[:i+1]). So a prefix-cache hit can be checked independently: the reused blocks must hold
exactly the K/V of the new prompt's prefix.
"""

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lessonlib.kv_cache import BlockAllocator, OutOfBlocks, PagedKVCache
from tests.conftest import DEVICE

HEADS, DIM = 2, 4
DOCUMENTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 7, 7, 7], [5, 5, 5, 5, 5, 5]]


def kv_for(prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seed = int.from_bytes(hashlib.sha256(repr(prefix).encode()).digest()[:7], "little")
    kv = torch.randn(2, HEADS, DIM, generator=torch.Generator().manual_seed(seed))
    return kv[0], kv[1]


def expected_kv(tokens: list[int]):
    rows = [kv_for(tokens[: i + 1]) for i in range(len(tokens))]
    if not rows:
        return torch.empty(0, HEADS, DIM), torch.empty(0, HEADS, DIM)
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def snapshot(cache: PagedKVCache):
    a = cache.allocator
    return (
        {s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths), list(a.ref_counts), list(a._free),
        dict(a.block_with), cache.k_cache.clone(), cache.v_cache.clone(),
    )


def assert_unchanged(before, cache):
    after = snapshot(cache)
    for x, y in zip(before[:5], after[:5]):
        assert x == y
    assert torch.equal(before[5], after[5]) and torch.equal(before[6], after[6])


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.block_size = 2
        self.cache = PagedKVCache(num_blocks=12, block_size=self.block_size, num_kv_heads=HEADS, head_dim=DIM,
                                  dtype=torch.float32, device=DEVICE)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(doc=st.integers(0, len(DOCUMENTS) - 1), length=st.integers(0, 10))
    def add(self, doc, length):
        prompt = DOCUMENTS[doc][:length]
        cached = self.cache.add_sequence(self.next_id, prompt)
        assert cached % self.block_size == 0 and cached <= len(prompt)
        self.tokens[self.next_id] = prompt[:cached]
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 9), min_size=1, max_size=5))
    def append(self, data, new):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq] + new
        k, v = expected_kv(tokens)
        k, v = k[len(self.tokens[seq]):].to(DEVICE), v[len(self.tokens[seq]):].to(DEVICE)
        before = snapshot(self.cache)
        try:
            self.cache.append(seq, k, v, token_ids=new)
        except OutOfBlocks as e:
            assert e.needed > e.free == self.cache.allocator.num_free
            assert_unchanged(before, self.cache)
            return
        self.tokens[seq] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.fork(parent, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq)
        del self.tokens[seq]
        before = snapshot(self.cache)
        with pytest.raises(KeyError, match="already freed"):
            self.cache.free(seq)
        assert_unchanged(before, self.cache)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def bad_append(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = snapshot(self.cache)
        with pytest.raises((ValueError, TypeError)):
            self.cache.append(seq, torch.zeros(2, HEADS, DIM + 1, device=DEVICE), torch.zeros(2, HEADS, DIM + 1, device=DEVICE))
        with pytest.raises(TypeError):
            self.cache.append(seq, torch.zeros(1, HEADS, DIM, dtype=torch.float16, device=DEVICE),
                              torch.zeros(1, HEADS, DIM, dtype=torch.float16, device=DEVICE))
        with pytest.raises(KeyError):
            self.cache.add_sequence(seq)
        assert_unchanged(before, self.cache)

    @invariant()
    def reference_counts_are_exact(self):
        a = self.cache.allocator
        uses = [0] * a.num_blocks
        for table in self.cache.tables.values():
            for b in table:
                uses[b] += 1
        assert uses == a.ref_counts
        assert set(a._free) == {b for b, n in enumerate(uses) if n == 0}  # nothing leaked, nothing double-listed
        assert a.num_free + sum(1 for n in uses if n) == a.num_blocks

    @invariant()
    def tables_fit_lengths(self):
        for seq, table in self.cache.tables.items():
            assert len(table) == -(-self.cache.lengths[seq] // self.block_size)

    @invariant()
    def every_sequence_reads_back_exactly(self):
        assert set(self.cache.tables) == set(self.tokens)
        for seq, tokens in self.tokens.items():
            k, v = self.cache.read(seq)
            ek, ev = expected_kv(tokens)
            assert torch.equal(k.cpu(), ek) and torch.equal(v.cpu(), ev), f"sequence {seq}"


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_prefix_cache_hit_shares_blocks_and_survives_free():
    cache = PagedKVCache(8, 4, HEADS, DIM, dtype=torch.float32, device=DEVICE)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    cache.add_sequence("a", prompt)
    k, v = expected_kv(prompt)
    cache.append("a", k.to(DEVICE), v.to(DEVICE), token_ids=prompt)
    cache.free("a")  # its two full blocks stay cached while free
    assert cache.add_sequence("b", prompt[:8] + [7]) == 8
    assert cache.allocator.num_free == 6
    assert cache.add_sequence("c", [3, 1, 4, 2]) == 0  # a different first block: no hit


def test_copy_on_write_keeps_the_parent_intact():
    cache = PagedKVCache(8, 4, HEADS, DIM, dtype=torch.float32, device=DEVICE)
    cache.add_sequence("p")
    k = torch.randn(6, HEADS, DIM, device=DEVICE)
    cache.append("p", k, k)
    cache.fork("p", "c")
    assert cache.block_table(["p"]).tolist() == cache.block_table(["c"]).tolist()
    extra = torch.randn(1, HEADS, DIM, device=DEVICE)
    cache.append("c", extra, extra)
    assert cache.tables["c"][0] == cache.tables["p"][0] and cache.tables["c"][1] != cache.tables["p"][1]
    assert torch.equal(cache.read("p")[0], k)
    assert torch.equal(cache.read("c")[0], torch.cat([k, extra]))


def test_out_of_blocks_names_the_numbers_and_changes_nothing():
    cache = PagedKVCache(2, 4, HEADS, DIM, dtype=torch.float32, device=DEVICE)
    cache.add_sequence("a")
    before = snapshot(cache)
    with pytest.raises(OutOfBlocks, match="3 needed, 2 free"):
        cache.append("a", torch.zeros(9, HEADS, DIM, device=DEVICE), torch.zeros(9, HEADS, DIM, device=DEVICE))
    assert_unchanged(before, cache)


def test_block_table_is_padded_and_int32():
    cache = PagedKVCache(8, 2, HEADS, DIM, dtype=torch.float32, device=DEVICE)
    for seq, n in (("a", 5), ("b", 1)):
        cache.add_sequence(seq)
        cache.append(seq, torch.zeros(n, HEADS, DIM, device=DEVICE), torch.zeros(n, HEADS, DIM, device=DEVICE))
    table = cache.block_table(["a", "b"])
    assert table.dtype == torch.int32 and table.shape == (2, 3) and table[1, 1:].tolist() == [-1, -1]
    assert cache.seq_lens(["a", "b"]).tolist() == [5, 1]
    with pytest.raises(KeyError, match="unknown sequence"):
        cache.block_table(["zzz"])


def test_allocator_rejects_double_release():
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.release(block)
    with pytest.raises(RuntimeError, match="released more often"):
        allocator.release(block)
