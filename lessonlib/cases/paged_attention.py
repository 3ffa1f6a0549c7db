"""Lesson 03's timed cases, shared by ``benchmarks/bench_paged_attention.py`` (the recorded run) and the notebook's
"measure on this GPU" view (:mod:`lessonlib.widgets.recorded`), each checked against float64 first: decode attention
through a paged KV cache against SDPA on a contiguous cache (GB/s: the K and V bytes each call must read), and
rope_store_kv against the kernels it replaces (GB/s: the fused kernel's bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lessonlib import ops, reference, runtime, traffic
from lessonlib.bench import Case
from lessonlib.measure import copy_call
from lessonlib.ops.rope_store_kv import apply_rope_then_store_kv
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


def rope_store_kv_case(tokens, heads, kv_heads, head_dim, block_size, dtype):
    """ops.rope_store_kv against the kernels it replaces and plain PyTorch, each writing into its own pool."""
    device, width = runtime.device(), (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, device=device, dtype=torch.float32).to(dtype)
    cos, sin = reference.rope_cos_sin(torch.randint(0, 32768, (tokens,), device=device), head_dim, dtype=dtype)
    num_blocks = -(-tokens // block_size) * 2
    pools = {name: [torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
                    for _ in range(2)] for name in ("fused", "separate", "float64", "low")}
    pools["float64"] = [p.double() for p in pools["float64"]]
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    sizes = dict(num_heads=heads, num_kv_heads=kv_heads)
    # The two kernels alone: q and k copied once, outside the timing, into (T, heads, D) rows seen as (1, heads, T, D)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q4 = q.contiguous().view(tokens, heads, head_dim).transpose(0, 1)[None]
    k4 = k.contiguous().view(tokens, kv_heads, head_dim).transpose(0, 1)[None]
    v = v.view(tokens, kv_heads, head_dim)

    def two_kernels():
        _, k_rot = ops.apply_rope(q4, k4, cos, sin)
        ops.store_kv(k_rot[0].transpose(0, 1), v, *pools["separate"], slots, validate=False)

    def check():
        q = ops.rope_store_kv(qkv, cos, sin, *pools["fused"], slots, **sizes)
        q_separate = apply_rope_then_store_kv(qkv, cos, sin, *pools["separate"], slots, **sizes)
        assert torch.equal(q, q_separate), "rope_store_kv: q differs from apply_rope's"
        assert all(torch.equal(a, b) for a, b in zip(pools["fused"], pools["separate"])), "rope_store_kv: caches differ"
        truth = reference.rope_store_kv(*to_float64(qkv, cos, sin), *pools["float64"], slots, **sizes)
        check_close("rope_store_kv q", q, truth, reference.rope_store_kv(qkv, cos, sin, *pools["low"], slots, **sizes))
        check_close("rope_store_kv k_cache", pools["fused"][0], pools["float64"][0], pools["low"][0])

    nbytes = traffic.rope_store_kv(tokens, heads, kv_heads, head_dim, qkv.element_size()).fused.bytes
    peers = {Impl.LESSONLIB: lambda: ops.rope_store_kv(qkv, cos, sin, *pools["fused"], slots, **sizes, validate=False),
             Impl.APPLY_ROPE_THEN_STORE_KV: two_kernels,
             Impl.COPIES_APPLY_ROPE_STORE_KV: lambda: apply_rope_then_store_kv(qkv, cos, sin, *pools["separate"], slots,
                                                                               **sizes),
             Impl.EAGER: lambda: reference.rope_store_kv(qkv, cos, sin, *pools["low"], slots, **sizes),
             Impl.COPY: copy_call(nbytes)}
    shape = {"T": tokens, "H": heads, "Hkv": kv_heads, "D": head_dim, "block_size": block_size}
    return Case(Op.ROPE_STORE_KV, shape, peers, check, nbytes, graphed=tuple(peers), may_fail=(Impl.EAGER,))
