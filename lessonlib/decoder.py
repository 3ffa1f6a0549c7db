"""One Llama-style decoder layer's decode step over a paged KV cache: the workload of lesson 05.

    residual add + RMSNorm -> QKV projection -> RoPE -> write K, V into the cache -> paged attention
    -> output projection -> residual add + RMSNorm -> GatedMLP

``DecoderLayer.step`` runs it with plain PyTorch ops (``lessonlib.reference``); ``DecoderLayer.fused_step`` with
lessonlib's kernels (add_rms_norm, apply_rope, store_kv, paged_attention, FusedGatedMLP). Both take the same
tensors, so a decode step can be captured into a CUDA graph: everything a step reads lives in tensors whose
addresses do not change (``DecodeInputs``), and the host-side bookkeeping (which block a new token goes to) happens
before the step, outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lessonlib import reference
from lessonlib.kv_cache import OutOfBlocks, PagedKVCache


@dataclass
class DecodeInputs:
    """What one decode step reads, as tensors (static buffers when graph-captured).

    hidden, residual: (B, hidden); cos, sin: (B, 1, head_dim) for each sequence's new position; slots: (B,) int64,
    where each new token's K and V go (block * block_size + offset); block_table: (B, max_blocks) int32;
    seq_lens: (B,) int32, lengths *including* the new token.
    """

    hidden: torch.Tensor
    residual: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    def copy_(self, other: "DecodeInputs") -> "DecodeInputs":
        """Copy ``other`` into these tensors in place (how a graph's static inputs are refreshed before a replay)."""
        for name in self.__dataclass_fields__:
            getattr(self, name).copy_(getattr(other, name))
        return self


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, device=None,
                 dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False, **factory)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False, **factory)
        self.input_norm = nn.Parameter(1 + 0.1 * torch.randn(hidden, **factory))
        self.post_attention_norm = nn.Parameter(1 + 0.1 * torch.randn(hidden, **factory))
        self.mlp = reference.GatedMLP(hidden, intermediate, **factory)
        self._fused_mlp = None

    def _split_qkv(self, normed):
        batch = normed.shape[0]
        q, k, v = self.qkv_proj(normed).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        return (q.view(batch, self.heads, 1, self.head_dim), k.view(batch, self.kv_heads, 1, self.head_dim),
                v.view(batch, self.kv_heads, self.head_dim))

    def step(self, inputs: DecodeInputs, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """The decode step in plain PyTorch. Writes the new K, V into the cache; returns (hidden, residual)."""
        normed, residual = reference.add_rms_norm(inputs.hidden, inputs.residual, self.input_norm)
        q, k, v = self._split_qkv(normed)
        q, k = reference.apply_rope(q, k, inputs.cos, inputs.sin)
        flat_k = k_cache.view(-1, self.kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.kv_heads, self.head_dim)
        flat_k[inputs.slots] = k[:, :, 0]
        flat_v[inputs.slots] = v
        attn = reference.paged_attention(q[:, :, 0], k_cache, v_cache, inputs.block_table, inputs.seq_lens)
        normed, residual = reference.add_rms_norm(self.o_proj(attn.flatten(1)), residual, self.post_attention_norm)
        return self.mlp(normed), residual

    def fused_step(self, inputs: DecodeInputs, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """The same step with lessonlib's kernels; no host sync inside (tables are trusted: built
        by the cache)."""
        from lessonlib import ops

        if self._fused_mlp is None:
            self._fused_mlp = ops.FusedGatedMLP(self.mlp)
        normed, residual = ops.add_rms_norm(inputs.hidden, inputs.residual, self.input_norm)
        q, k, v = self._split_qkv(normed)
        q, k = ops.apply_rope(q, k, inputs.cos, inputs.sin)
        ops.store_kv(k[:, :, 0], v, k_cache, v_cache, inputs.slots, validate=False)
        attn = ops.paged_attention(q[:, :, 0], k_cache, v_cache, inputs.block_table,
                                   inputs.seq_lens, validate=False)
        normed, residual = ops.add_rms_norm(self.o_proj(attn.flatten(1)), residual,
                                            self.post_attention_norm)
        return self._fused_mlp(normed), residual


def next_token_inputs(cache: PagedKVCache, seq_ids, hidden: torch.Tensor, residual: torch.Tensor,
                      max_blocks: int, base: float = 10000.0) -> DecodeInputs:
    """Host-side bookkeeping for one decode step: reserve each sequence's next slot in the cache (a new block when
    the last one is full), and build the step's tensors. ``max_blocks`` fixes the block table's width, so that every
    step's tensors have the same shapes (a captured graph needs that)."""
    # Check everything first, so that an error leaves the cache as it was.
    needed = 0
    for seq in seq_ids:
        length, table = cache.lengths[seq], cache.tables[seq]
        if -(-(length + 1) // cache.block_size) > max_blocks:
            raise ValueError(f"sequence {seq!r} would need {-(-(length + 1) // cache.block_size)} blocks, more than "
                             f"max_blocks={max_blocks}")
        shared_last = length % cache.block_size != 0 and cache.allocator.ref_counts[table[-1]] > 1
        needed += length % cache.block_size == 0 or shared_last
    if not cache.allocator.can_allocate(needed):
        raise OutOfBlocks(needed, cache.allocator.num_free)
    slots, positions = [], []
    for seq in seq_ids:
        position = cache.lengths[seq]
        cache.reserve(seq, 1)
        block = cache.tables[seq][position // cache.block_size]
        slots.append(block * cache.block_size + position % cache.block_size)
        positions.append(position)
    device = cache.k_cache.device
    table = cache.block_table(seq_ids)
    table = torch.nn.functional.pad(table, (0, max_blocks - table.shape[1]), value=-1)
    cos, sin = reference.rope_cos_sin(torch.tensor(positions, device=device)[:, None], cache.head_dim, base,
                                      dtype=hidden.dtype)
    return DecodeInputs(hidden, residual, cos, sin, torch.tensor(slots, dtype=torch.int64, device=device), table,
                        cache.seq_lens(seq_ids))
