"""Lesson 03's timed case, shared by ``benchmarks/bench_paged_attention.py`` (the recorded run) and the notebook's
"measure on this GPU" view (:mod:`lessonlib.widgets.recorded`): decode attention through a paged KV cache against
SDPA on a contiguous cache, checked against float64 first. GB/s counts the K and V bytes each call must read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lessonlib import ops, reference, runtime
from lessonlib.bench import Case
from lessonlib.results import Impl, Op
from lessonlib.testing import check_close, to_float64

def build(batch, context, heads, kv_heads, head_dim, block_size, dtype):
    """A pool holding every sequence's blocks in shuffled order, the block tables, and the same K/V contiguous."""
    device = runtime.device()
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=torch.float32).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=torch.float32).to(dtype)
    table = torch.randperm(num_blocks, device=device).to(torch.int32).reshape(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.float32).to(dtype)
    return q, k_cache, v_cache, table, lens


def gather(cache, table, context):
    """(B, Hkv, context, D): the pages of each sequence, in logical order."""
    b, n = table.shape
    pages = cache[table.long().reshape(-1)].reshape(b, n * cache.shape[1], cache.shape[2], cache.shape[3])
    return pages[:, :context].transpose(1, 2)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


def decode_case(batch, context, heads, kv_heads, head_dim, block_size, dtype, graphed=True):
    """Decode attention at one (batch, context): lessonlib (with and without its per-call table checks), SDPA on the
    same K/V laid out contiguously, and gather-then-SDPA; lessonlib checked against float64 first. Returns the Case
    and what the benchmark's further cases reuse: the paged inputs, the two references, the shape and the bytes."""
    q, k_cache, v_cache, table, lens = build(batch, context, heads, kv_heads, head_dim, block_size, dtype)
    paged = (q, k_cache, v_cache, table, lens)
    truth = reference.paged_attention(*to_float64(q, k_cache, v_cache), table, lens)
    low = reference.paged_attention(*paged)
    k, v = gather(k_cache, table, context).contiguous(), gather(v_cache, table, context).contiguous()
    nbytes = 2 * batch * context * kv_heads * head_dim * k.element_size()
    shape = {"B": batch, "context": context, "H": heads, "Hkv": kv_heads, "D": head_dim, "block_size": block_size}
    # The kernels with validate=False; the table checks cost a device sync per call (timed separately, and
    # a sync cannot be graph-captured).
    peers = {Impl.LESSONLIB: lambda: ops.paged_attention(*paged, validate=False),
             Impl.TABLES_VALIDATED: lambda: ops.paged_attention(*paged),
             Impl.SDPA_CONTIGUOUS: lambda: sdpa(q, k, v),
             Impl.GATHER_THEN_SDPA: lambda: sdpa(q, gather(k_cache, table, context), gather(v_cache, table, context))}
    case = Case(Op.PAGED_ATTENTION, shape, peers,
                lambda: check_close("paged_attention", ops.paged_attention(*paged), truth, low), nbytes,
                graphed=tuple(i for i in peers if i != Impl.TABLES_VALIDATED) if graphed else None)
    return case, paged, (truth, low), shape, nbytes
