"""Paged decode attention through PyTorch's FlexAttention, on the same pages lessonlib's kernel reads: the peer
lesson 03 runs beside ``lessonlib.ops.paged_attention`` (and ``benchmarks/bench_paged_attention.py`` times).

FlexAttention takes a *block mask*; PyTorch's paged-attention helper (``torch.nn.attention.experimental.
_paged_attention.PagedAttention``, private and experimental) converts a mask over logical positions into one over
physical pages through a page table. ``torch.compile`` turns the call into one fused kernel: Triton on a GPU,
C++ on the CPU (Inductor's CPU template for flex attention).
"""

from __future__ import annotations

import torch


def flex_paged_attention(q, k_cache, v_cache, block_table, seq_lens):
    """A function of no arguments computing decode attention like ``lessonlib.reference.paged_attention``
    (q: (B, H, D); caches: (num_blocks, block_size, Hkv, D); block_table: (B, max_blocks) int32; seq_lens: (B,)).
    The set-up (the cache relaid as flex wants it, the converted block mask, compilation on first call) is done
    here or on the first call, so timing the returned function times attention alone."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    max_blocks = block_table.shape[1]
    # Flex's paged cache is one sequence of pages per KV head: (1, Hkv, num_blocks * block_size, D).
    k_flex = k_cache.permute(2, 0, 1, 3).reshape(1, kv_heads, num_blocks * block_size, head_dim)
    v_flex = v_cache.permute(2, 0, 1, 3).reshape(1, kv_heads, num_blocks * block_size, head_dim)
    paged = PagedAttention(num_blocks, block_size, batch, device=q.device)
    paged.page_table[:, :max_blocks] = block_table.long()
    rows = torch.arange(batch, device=q.device)[:, None]
    logical_index = torch.arange(max_blocks, device=q.device)[None, :].expand(batch, -1)
    paged.physical_to_logical[rows, block_table.long()] = logical_index
    lens = seq_lens.long()
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < lens[b], batch, None, 1,
                                max_blocks * block_size, device=q.device, BLOCK_SIZE=block_size)
    block_mask = paged.convert_logical_block_mask(logical, kv_len=lens)
    compiled = torch.compile(flex_attention, fullgraph=True)
    q4 = q[:, :, None]  # (B, H, 1, D): one query token per sequence
    return lambda: compiled(q4, k_flex, v_flex, block_mask=block_mask, enable_gqa=True)[:, :, 0]
