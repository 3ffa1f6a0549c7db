"""vLLM's own KV-cache manager, driven by hand with no engine and no model (lesson 06 compares it with
:mod:`lessonlib.kv_cache`). Its block hashes are vLLM's (``get_request_block_hasher``), not
``kv_cache.block_digest``: the point is to watch vLLM's own bookkeeping, so nothing of the course's replaces it."""

from __future__ import annotations

from typing import Sequence

import torch

from lessonlib.serving.settings import require_vllm


class VllmBlockManager:
    """vLLM's own KV-cache manager (``vllm.v1.core.kv_cache_manager.KVCacheManager``, plain Python), driven by hand
    as its scheduler drives it, with no engine and no model: requests arrive with prompt token ids, get blocks,
    hit the prefix cache, and are freed.

    vLLM keeps block 0 as a "null block" that is never handed out, so a pool of ``num_blocks`` holds
    ``num_blocks - 1`` usable blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_kv_heads: int = 2, head_dim: int = 32,
                 dtype: torch.dtype = torch.float16, max_model_len: int = 4096):
        require_vllm()
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_dim, dtype=dtype)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["attention"], spec)])
        self.block_size = block_size
        self.manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                                      hash_block_size=block_size, enable_caching=True)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._requests = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
        """Admit a request, as the scheduler does: look up cached full blocks, allocate the rest. Returns how many
        prompt tokens were found in the prefix cache."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        if request_id in self._requests:
            raise KeyError(f"request {request_id!r} is already in the manager")
        request = Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=1), None,
                          block_hasher=self._hasher)
        cached_blocks, num_cached, _ = self.manager.get_computed_blocks(request)
        allocated = self.manager.allocate_slots(request, request.num_tokens - num_cached, num_cached, cached_blocks)
        if allocated is None:
            raise RuntimeError(f"vLLM's manager has too few free blocks for request {request_id!r}")
        request.num_computed_tokens = request.num_tokens
        self.manager.cache_blocks(request, request.num_tokens)  # full blocks become findable by their hash
        self._requests[request_id] = request
        return num_cached

    def free(self, request_id: str) -> None:
        self.manager.free(self._requests.pop(request_id))

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.manager.get_block_ids(request_id)[0])

    def ref_counts(self) -> dict[int, int]:
        """{block id: reference count} for every block in use."""
        return {block.block_id: block.ref_cnt for block in self.manager.block_pool.blocks if block.ref_cnt > 0}

    @property
    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.manager.usage
