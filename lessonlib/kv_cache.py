"""A paged KV cache: a fixed pool of physical blocks, per-sequence block tables, prefix sharing, copy-on-write.

Bookkeeping only (plain Python, as vLLM's and nano-vllm's block managers are): which block holds which tokens.
Writing K and V into the pool is one Triton kernel, ``lessonlib.ops.store_kv``; reading through the block tables is
``lessonlib.ops.paged_attention``.

Every operation validates everything first and mutates only when it cannot fail any more, so an error leaves the
cache exactly as it was.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Hashable, Sequence

import torch


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than an operation needs."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"out of KV-cache blocks: {needed} needed, {free} free")
        self.needed, self.free = needed, free


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks with reference counts, and the prefix-cache registry.

    A block is *in use* while its count is above zero. A freed block that holds a full block of known content
    (a prefix-cache entry) stays findable by its hash until the allocator hands it out again, oldest freed first.
    The one block bookkeeping of the course: :class:`PagedKVCache` (one layer's pool, lesson 03) and the engine's
    ``BlockManager`` (every layer's pools indexed by the same block ids, lesson 07) both keep their blocks here, and
    both name a full block by :func:`block_digest`.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # oldest first
        self.hash_of: dict[int, Hashable] = {}  # block -> content hash, for full blocks
        self.block_with: dict[Hashable, int] = {}  # content hash -> block

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks(1, 0)
        block, _ = self._free.popitem(last=False)
        self._forget_hash(block)  # its old content is about to be overwritten
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more sequence uses ``block``; a cached free block comes back into use."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} released more often than it was taken")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None

    def register(self, block: int, content_hash: Hashable) -> None:
        """Record that ``block`` holds a full block with this content (first writer wins)."""
        if content_hash not in self.block_with and block not in self.hash_of:
            self.block_with[content_hash] = block
            self.hash_of[block] = content_hash

    def lookup(self, content_hash: Hashable) -> int | None:
        return self.block_with.get(content_hash)

    def cached_prefix(self, token_ids: Sequence[int], block_size: int, max_blocks: int) -> tuple[list[int], list[bytes]]:
        """The prefix-cache blocks that hold the leading full blocks of ``token_ids`` (at most ``max_blocks``), and
        their digests: the lookup stops at the first block not cached. Changes nothing (share the blocks to use them)."""
        blocks: list[int] = []
        digests: list[bytes] = []
        for i in range(min(max_blocks, len(token_ids) // block_size)):
            digest = block_digest(digests, token_ids[i * block_size:(i + 1) * block_size])
            block = self.lookup(digest)
            if block is None:
                break
            blocks.append(block)
            digests.append(digest)
        return blocks, digests

    def register_full(self, block: int, digests: list[bytes], block_tokens: Sequence[int]) -> None:
        """``block`` now holds ``block_tokens``, the full block after those ``digests`` names: append its digest to
        ``digests`` and make it a prefix-cache entry."""
        digests.append(block_digest(digests, block_tokens))
        self.register(block, digests[-1])

    def forget_prefix_cache(self) -> None:
        """Drop every prefix-cache entry (blocks in use stay in use; none is findable by its content any more)."""
        self.block_with.clear()
        self.hash_of.clear()

    def _forget_hash(self, block: int) -> None:
        content_hash = self.hash_of.pop(block, None)
        if content_hash is not None:
            del self.block_with[content_hash]


class PagedKVCache:
    """K and V for many sequences in one pool of fixed-size blocks.

    ``k_cache`` and ``v_cache`` have shape (num_blocks, block_size, num_kv_heads, head_dim). Sequence ``s`` keeps a
    block table: its logical block ``i`` (tokens ``i*block_size ... (i+1)*block_size - 1``) lives in physical block
    ``table[s][i]``. Blocks come from the pool on demand, one at a time, so no sequence reserves memory it has not
    used yet.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: torch.device | str | None = None):
        for name, value in (("block_size", block_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        if device is None:
            from lessonlib import runtime

            device = runtime.device()
        self.block_size, self.num_kv_heads, self.head_dim, self.dtype = block_size, num_kv_heads, head_dim, dtype
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}
        # Prefix caching: token ids of each sequence's unfinished block, and a digest per full block chained over
        # everything before it (two blocks with the same tokens after different prefixes hold different K/V).
        self._pending: dict[Hashable, list[int]] = {}
        self._digests: dict[Hashable, list[bytes]] = {}
        self._hashable: dict[Hashable, bool] = {}  # False once a sequence appended K/V without token ids

    # --- sequences ---------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, prompt_token_ids: Sequence[int] | None = None) -> int:
        """Start a sequence. With ``prompt_token_ids``, reuse every leading *full* block whose content is already
        cached (automatic prefix caching) and return how many tokens that covers: append K/V from there on."""
        if seq_id in self.tables:
            raise KeyError(f"sequence {seq_id!r} already exists")
        reused, digests = [], []
        if prompt_token_ids is not None:
            tokens = [int(t) for t in prompt_token_ids]
            reused, digests = self.allocator.cached_prefix(tokens, self.block_size, len(tokens) // self.block_size)
        for block in reused:
            self.allocator.share(block)
        self.tables[seq_id] = reused
        self.lengths[seq_id] = len(reused) * self.block_size
        self._pending[seq_id] = []
        self._digests[seq_id] = digests
        self._hashable[seq_id] = True
        return self.lengths[seq_id]

    def append(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor, token_ids: Sequence[int] | None = None) -> None:
        """Append T tokens' keys and values, each (T, num_kv_heads, head_dim), allocating blocks as needed. With
        ``token_ids`` (T of them), every block this fills becomes a prefix-cache entry."""
        self._check_kv(seq_id, k, v, token_ids)
        n_new = k.shape[0]
        if n_new == 0:
            return
        table = self.tables[seq_id]
        slots = self._grow(seq_id, n_new)
        from lessonlib.ops import store_kv

        store_kv(k, v, self.k_cache, self.v_cache, slots, validate=False)  # distinct and in range by construction
        if token_ids is None:
            self._hashable[seq_id] = False
        elif self._hashable[seq_id]:
            pending, digests = self._pending[seq_id], self._digests[seq_id]
            for token in token_ids:
                pending.append(int(token))
                if len(pending) == self.block_size:  # a block just filled up: it becomes a prefix-cache entry
                    self.allocator.register_full(table[len(digests)], digests, pending)
                    pending.clear()

    def reserve(self, seq_id: Hashable, n: int) -> torch.Tensor:
        """Make room for ``n`` more tokens (new blocks, copy-on-write of a shared last block) without writing them,
        and return their slots, (n,) int64: block * block_size + offset. For a caller that writes K and V itself,
        such as a decode step captured in a CUDA graph. Tokens added this way are not prefix-cached."""
        self._known([seq_id])
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"reserve: n must be a non-negative int, got {n!r}")
        slots = self._grow(seq_id, n)
        self._hashable[seq_id] = False
        return slots

    def _grow(self, seq_id: Hashable, n_new: int) -> torch.Tensor:
        """Allocate what n_new more tokens need (all or nothing), advance the length, return the new slots."""
        table, length = self.tables[seq_id], self.lengths[seq_id]
        last_shared = length % self.block_size != 0 and self.allocator.ref_counts[table[-1]] > 1
        new_blocks = -(-(length + n_new) // self.block_size) - len(table)
        needed = new_blocks + (1 if last_shared and n_new else 0)
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocks(needed, self.allocator.num_free)
        # Nothing below can fail: mutate.
        if last_shared and n_new:  # copy-on-write: this sequence gets its own copy of the partly filled block
            old, new = table[-1], self.allocator.allocate()
            self.k_cache[new].copy_(self.k_cache[old])
            self.v_cache[new].copy_(self.v_cache[old])
            self.allocator.release(old)
            table[-1] = new
        table.extend(self.allocator.allocate() for _ in range(new_blocks))
        positions = torch.arange(length, length + n_new, device=self.k_cache.device)
        blocks = torch.tensor(table, dtype=torch.int64, device=self.k_cache.device)[positions // self.block_size]
        self.lengths[seq_id] = length + n_new
        return blocks * self.block_size + positions % self.block_size

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child starts as the parent's exact copy, sharing every block (e.g. parallel sampling)."""
        if parent_id not in self.tables:
            raise KeyError(f"unknown sequence {parent_id!r}")
        if child_id in self.tables:
            raise KeyError(f"sequence {child_id!r} already exists")
        for block in self.tables[parent_id]:
            self.allocator.share(block)
        self.tables[child_id] = list(self.tables[parent_id])
        self.lengths[child_id] = self.lengths[parent_id]
        self._pending[child_id] = list(self._pending[parent_id])
        self._digests[child_id] = list(self._digests[parent_id])
        self._hashable[child_id] = self._hashable[parent_id]

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; blocks no other sequence uses return to the pool (full ones stay prefix-cached)."""
        if seq_id not in self.tables:
            raise KeyError(f"unknown sequence {seq_id!r} (never added, or already freed)")
        for block in self.tables.pop(seq_id):
            self.allocator.release(block)
        del self.lengths[seq_id], self._pending[seq_id], self._digests[seq_id], self._hashable[seq_id]

    # --- what the kernel reads ---------------------------------------------------------------------------------
    def block_table(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """(B, max blocks) int32; rows shorter than the longest are padded with -1 (never read: see seq_lens)."""
        self._known(seq_ids)
        width = max((len(self.tables[s]) for s in seq_ids), default=0)
        rows = [self.tables[s] + [-1] * (width - len(self.tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32, device=self.k_cache.device).reshape(len(seq_ids), width)

    def seq_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        self._known(seq_ids)
        return torch.tensor([self.lengths[s] for s in seq_ids], dtype=torch.int32, device=self.k_cache.device)

    def read(self, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V gathered back into (length, num_kv_heads, head_dim): for tests and teaching."""
        self._known([seq_id])
        length = self.lengths[seq_id]
        blocks = torch.tensor(self.tables[seq_id], dtype=torch.int64, device=self.k_cache.device)
        k = self.k_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        v = self.v_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        return k, v

    # --- helpers -----------------------------------------------------------------------------------------------
    def _known(self, seq_ids) -> None:
        for s in seq_ids:
            if s not in self.tables:
                raise KeyError(f"unknown sequence {s!r}")

    def _check_kv(self, seq_id, k, v, token_ids) -> None:
        self._known([seq_id])
        expected = (self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"append: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != expected:
                raise ValueError(f"append: {name} must be (T, {expected[0]}, {expected[1]}), got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"append: {name} is {t.dtype}, the cache holds {self.dtype}")
            if t.device != self.k_cache.device:
                raise ValueError(f"append: {name} is on {t.device}, the cache on {self.k_cache.device}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"append: k has {k.shape[0]} tokens, v has {v.shape[0]}")
        if token_ids is not None and len(token_ids) != k.shape[0]:
            raise ValueError(f"append: {len(token_ids)} token ids for {k.shape[0]} tokens")


def block_digest(digests: Sequence[bytes], block_tokens: Sequence[int]) -> bytes:
    """The prefix cache's name for a full block that follows the blocks named ``digests``: SHA-256 over the previous
    block's digest and this block's token ids, so it names everything before it too (two blocks with the same tokens
    after different prefixes hold different K/V). The one definition: lesson 03's cache and the engine both use it."""
    parent = digests[-1] if digests else b""
    return hashlib.sha256(parent + b"".join(int(t).to_bytes(8, "little", signed=True) for t in block_tokens)).digest()
