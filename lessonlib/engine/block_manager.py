"""Which physical KV-cache blocks each sequence holds: lesson 03's BlockAllocator (reference counts, a free list,
the prefix-cache registry) and its chained block digests (``kv_cache.block_digest``), driven for many layers at once.

``lessonlib.kv_cache.PagedKVCache`` keeps one layer's K/V pool and its bookkeeping together; the engine has one pool
per layer indexed by the *same* block ids, so it keeps the bookkeeping here, apart from any tensor (as nano-vllm's
and vLLM's block managers do). No kernel is called from this file.

Prefix caching: a full block is identified by a digest chained over every token before it. At admission a prompt's
leading full blocks are looked up; a hit is shared (its reference count goes up) instead of recomputed. A prompt
never reuses its last token's block: the last token must run through the model to give the next token's logits.
"""

from __future__ import annotations

from lessonlib.kv_cache import BlockAllocator
from lessonlib.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._digests: dict[int, list[bytes]] = {}  # seq_id -> digest of each full block it holds

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- admission (prefill) -------------------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Blocks of the prefix cache that hold this sequence's leading full blocks (all but the last token's, which
        must run through the model), and their digests. Changes nothing: :meth:`allocate` shares them."""
        return self.allocator.cached_prefix(seq.token_ids, self.block_size, (len(seq) - 1) // self.block_size)

    def prefix_hits(self, seq: Sequence) -> tuple[int, int]:
        """How many of ``seq``'s leading blocks the prefix cache holds (:meth:`cached_prefix`), and how many of those
        sit idle in the free list (a finished sequence's blocks stay findable there until they are handed out
        again): admitting ``seq`` takes the idle ones out of the pool, the busy ones cost no free block."""
        hits, _ = self.cached_prefix(seq)
        return len(hits), sum(self.allocator.ref_counts[b] == 0 for b in hits)

    def free_blocks_needed(self, seq: Sequence) -> int:
        """Free blocks admitting ``seq`` takes: its uncached blocks, plus its cached blocks that sit idle."""
        cached, idle = self.prefix_hits(seq)
        return self.blocks_for(len(seq)) - cached + idle

    def can_allocate(self, seq: Sequence) -> bool:
        return self.free_blocks_needed(seq) <= self.num_free

    def allocate(self, seq: Sequence, register: bool = True) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks. Call can_allocate first.
        ``register`` False (chunked prefill: the prompt's K/V are written over several steps): no new block joins
        the prefix cache here; each does once the step that writes it is scheduled (``register_written``)."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq):
            raise RuntimeError(f"sequence {seq.seq_id} does not fit: check can_allocate first")
        hits, digests = self.cached_prefix(seq)
        for block in hits:
            self.allocator.share(block)
        table = hits + [self.allocator.allocate() for _ in range(self.blocks_for(len(seq)) - len(hits))]
        # Register the prompt's other full blocks now: their K/V are written by this very prefill, in every layer
        # before any attention of that layer reads them, so a sequence admitted in the same step may share them.
        for i in range(len(hits), len(seq) // self.block_size if register else 0):
            self.allocator.register_full(table[i], digests, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
        seq.block_table = table
        seq.num_cached_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_prompt_cached_tokens = seq.num_cached_tokens
        self._digests[seq.seq_id] = digests

    # --- growth (decode) ---------------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Room for the K/V of the sequence's last token, the one the next decode step feeds."""
        return not self.needs_block(seq) or self.allocator.can_allocate(1)

    def needs_block(self, seq: Sequence) -> bool:
        """Whether the last token starts a new block (its position is past the blocks the sequence holds)."""
        return len(seq.block_table) * self.block_size < len(seq.token_ids)

    def append(self, seq: Sequence) -> None:
        """Make room for the last token's K/V: a new block when the previous one is full. The token itself may not
        be known yet (an asynchronous step schedules the next one before its tokens reach the host): only its
        position matters here."""
        if self.needs_block(seq):
            seq.block_table.append(self.allocator.allocate())

    def register_written(self, seq: Sequence, position: int) -> None:
        """A decode step has written the K/V of the token at ``position``: when that token fills its block, the block
        joins the prefix cache (its digest chains over tokens that are all known by then)."""
        if (position + 1) % self.block_size:
            return
        digests, i = self._digests[seq.seq_id], position // self.block_size
        if len(digests) == i:  # a chain with no gap (false once a sequence ran past what was hashed)
            self.allocator.register_full(seq.block_table[i], digests, seq.token_ids[i * self.block_size:position + 1])

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks (finished, or preempted); full ones stay prefix-cached until reused."""
        for block in reversed(seq.block_table):  # last blocks first: the free list hands out the oldest first,
            if 0 <= block < self.num_blocks:  # (not so in a table that LLM(check_kernels=True) refused)
                self.allocator.release(block)  # so a shared prefix's first blocks are the last to be overwritten
        seq.block_table = []
        seq.num_cached_tokens = 0
        self._digests.pop(seq.seq_id, None)

    def forget_blocks_of(self, seq: Sequence) -> None:
        """Take out of the prefix cache the blocks only ``seq`` holds (its K/V are not to be trusted: its step gave
        NaN/inf probabilities); blocks other sequences share, and every other entry, stay cached."""
        for block in seq.block_table:
            if self.allocator.ref_counts[block] == 1 and block in self.allocator.hash_of:
                self.allocator.block_with.pop(self.allocator.hash_of.pop(block), None)

    def forget_prefix_cache(self) -> None:
        """Drop every prefix-cache entry (after a failed step, whose blocks may hold half-written K/V)."""
        self.allocator.forget_prefix_cache()
