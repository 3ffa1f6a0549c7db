"""One block bookkeeping (issue 25): lesson 03's PagedKVCache and the engine's BlockManager keep their blocks in the
same BlockAllocator and name a full block by the same digest (kv_cache.block_digest), so a prompt's blocks are
found alike by both; the engine's manager answers the scheduler through public methods only."""

import random

import torch

from lessonlib.engine.block_manager import BlockManager
from lessonlib.engine.sequence import SamplingParams, Sequence
from lessonlib.kv_cache import PagedKVCache, block_digest
from tests.conftest import DEVICE

BLOCK = 5  # odd, so a prompt's last block is partly filled


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def lesson_03_cache(prompt: list[int]) -> PagedKVCache:
    cache = PagedKVCache(num_blocks=16, block_size=BLOCK, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=DEVICE)
    cache.add_sequence("a")
    kv = torch.randn(len(prompt), 1, 2, device=DEVICE)
    cache.append("a", kv, kv.clone(), token_ids=prompt)
    return cache


def test_the_engine_and_lesson_03s_cache_name_each_full_block_alike():
    rng = random.Random()
    prompt = tokens(3 * BLOCK + rng.randrange(1, BLOCK), rng)
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    manager.allocate(Sequence(list(prompt), SamplingParams()))
    cache = lesson_03_cache(prompt)
    chained = []
    for i in range(3):
        chained.append(block_digest(chained, prompt[i * BLOCK:(i + 1) * BLOCK]))
    assert set(manager.allocator.block_with) == set(cache.allocator.block_with) == set(chained)
    # the chain names the whole prefix: the same block of tokens after another first block has another digest
    other_first = tokens(BLOCK, rng)
    assert block_digest([block_digest([], other_first)], prompt[BLOCK:2 * BLOCK]) != chained[1]


def test_cached_prefix_finds_the_shared_blocks_and_changes_nothing():
    rng = random.Random()
    shared = tokens(2 * BLOCK, rng)
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    first = Sequence(shared + tokens(BLOCK + 2, rng), SamplingParams())
    manager.allocate(first)
    second = Sequence(shared + tokens(3, rng), SamplingParams())
    counts, free = list(manager.allocator.ref_counts), manager.num_free
    hits, digests = manager.cached_prefix(second)
    assert hits == first.block_table[:2] and len(digests) == 2
    assert manager.allocator.ref_counts == counts and manager.num_free == free
    # lesson 03's cache finds as many blocks for the same prompts: the same lookup
    cache = lesson_03_cache(first.token_ids)
    assert cache.add_sequence("b", second.token_ids) == len(hits) * BLOCK
    # a prompt of exactly the shared blocks: the engine leaves its last token's block to the model
    assert len(manager.cached_prefix(Sequence(list(shared), SamplingParams()))[0]) == 1


def test_forgetting_the_prefix_cache_keeps_blocks_in_use():
    rng = random.Random()
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    seq = Sequence(tokens(3 * BLOCK + 1, rng), SamplingParams())
    manager.allocate(seq)
    used = manager.num_used
    manager.forget_prefix_cache()
    again = Sequence(list(seq.token_ids), SamplingParams())
    assert manager.cached_prefix(again) == ([], [])
    assert manager.num_used == used and all(manager.allocator.ref_counts[b] == 1 for b in seq.block_table)


def test_the_scheduler_uses_the_block_managers_public_api_only():
    """No private method and no reach into the allocator: the scheduler reads ``self.blocks.<public name>``."""
    import ast
    import inspect

    from lessonlib.engine import scheduler

    used = {node.attr for node in ast.walk(ast.parse(inspect.getsource(scheduler)))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "blocks" and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}
    public = {name for name in dir(BlockManager) if not name.startswith("_")} | {"block_size"}
    assert used and used <= public, f"the scheduler uses {sorted(used - public)} of the block manager"
