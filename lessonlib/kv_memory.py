"""How much KV-cache memory serving reserves, against how much it uses: contiguous per-request slabs vs paged
blocks, over a realistic spread of request lengths (notebook 03)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def request_lengths(n: int = 256, median: int = 600, max_len: int = 4096, seed: int = 0) -> torch.Tensor:
    """Tokens (prompt + generated) per request: log-normal around ``median`` with a long tail, capped at
    ``max_len``. Real chat traffic looks like this: most requests short, a few near the context limit."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=generator, dtype=torch.float64) * 0.9) * median
    return lengths.round().clamp(1, max_len).to(torch.int64)


def kv_bytes_per_token(layers: int = 32, kv_heads: int = 8, head_dim: int = 128, itemsize: int = 2) -> int:
    """K and V of one token across all layers (Llama-3-8B: 32 layers, 8 KV heads, D=128, bf16 -> 128 KiB)."""
    return 2 * layers * kv_heads * head_dim * itemsize


@dataclass
class Reservation:
    used_tokens: int  # the logical KV elements: every token's K and V, once
    paged_tokens: int  # what paging holds: whole blocks, so up to block_size - 1 slots unused per request
    contiguous_tokens: int  # one max_len slab per request, reserved up front

    @property
    def paged_waste(self) -> float:
        return 1 - self.used_tokens / self.paged_tokens

    @property
    def contiguous_waste(self) -> float:
        return 1 - self.used_tokens / self.contiguous_tokens


def reservation(lengths: torch.Tensor, max_len: int, block_size: int) -> Reservation:
    """Token slots held for ``lengths`` when each request reserves a ``max_len`` slab, vs ``block_size`` blocks."""
    if block_size < 1 or max_len < 1:
        raise ValueError(f"block_size and max_len must be >= 1, got {block_size} and {max_len}")
    lengths = lengths.clamp(max=max_len)
    blocks = (lengths + block_size - 1) // block_size
    return Reservation(int(lengths.sum()), int(blocks.sum()) * block_size, len(lengths) * max_len)


@dataclass
class LargestBatch:
    slabs: int  # sequences that fit when each reserves a max_len slab up front
    blocks: int  # sequences that fit when each holds the blocks of its own length


def largest_batch(lengths: torch.Tensor, pool_tokens: int, max_len: int,
                  block_size: int) -> LargestBatch:
    """How many of the requests ``lengths`` (tokens each at its end, in arrival order) fit at once
    in a KV cache of ``pool_tokens`` slots: reserving a ``max_len`` slab each, or ``block_size``
    blocks each for what it uses (the first requests whose blocks add up to the pool). The vLLM
    paper's comparison, for the same memory."""
    if block_size < 1 or max_len < 1 or pool_tokens < 1:
        raise ValueError(f"pool_tokens, max_len and block_size must be >= 1, got {pool_tokens}, "
                         f"{max_len} and {block_size}")
    if lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(f"a request of {int(lengths.max())} tokens is longer than "
                         f"max_len={max_len}")
    blocks = torch.cumsum((lengths + block_size - 1) // block_size, 0)
    fits = int((blocks <= pool_tokens // block_size).sum())
    return LargestBatch(min(pool_tokens // max_len, len(lengths)), fits)
