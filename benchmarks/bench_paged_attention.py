"""Lesson 03's benchmark: decode attention through a paged KV cache, against SDPA on a contiguous cache.

    python -m benchmarks.bench_paged_attention --out lessonlib/results/paged-attention-h200.json

bf16, 32 query heads over 8 KV heads, head_dim 128, block_size 16; GB/s counts the K and V bytes each call must
read. Peers measured in the same run: SDPA on a contiguous cache (the same K/V, laid out densely), and gather the
pages then SDPA. Also: the cache's store_kv kernel writing a 4096-token prefill, against a copy of the same bytes;
and rope_store_kv (RoPE and the cache write fused) at decode and prefill sizes, against the separate kernels it
replaces (apply_rope + store_kv, with and without the engine's copies of q and k) and plain PyTorch.
Every case is checked against the float64 reference first. ``--smoke`` runs tiny sizes in any mode.
"""

from __future__ import annotations

import torch

from lessonlib import bench, ops, runtime
from lessonlib.bench import Case
from lessonlib.cases import paged_attention as cases
from lessonlib.cases.paged_attention import decode_case
from lessonlib.flex_paged import flex_paged_attention
from lessonlib.measure import copy_call, gbps, time_copy, warm_up_gpu
from lessonlib.results import Benchmark, Impl, Op, sweep_label
from lessonlib.testing import check_close


HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SMOKE_HEADS = (8, 2, 32, 16)
CONTEXTS = [(32, 4096), (64, 2048), (8, 16384), (1, 32768)]  # (batch, context)
SMOKE_CONTEXTS = [(2, 64), (1, 100)]
# The kernel's tuning knobs (ops.paged_attention's keywords), each point checked by the case's check, then timed.
KNOBS = [{"num_splits": s} for s in (1, 2, 4, 8, 16, 32, 64)] + [
    {"blocks_per_step": bps, "num_warps": w, "num_stages": st}
    for bps in (2, 4, 8) for w in (4, 8) for st in (2, 3, 4)] + [
    {"num_splits": s, "blocks_per_step": 8, "num_warps": 8} for s in (8, 16, 32, 64)]
STORE_TOKENS, SMOKE_STORE_TOKENS = 4096, 64
# rope_store_kv: (tokens, head_dim) with 32 query heads over 8 KV heads; decode steps of 1 to 64 sequences, a prefill
ROPE_STORE_KV_SHAPES = [(t, d) for d in (64, 128) for t in (1, 8, 32, 64, 4096)]
SMOKE_ROPE_STORE_KV_SHAPES = [(1, 32), (7, 32)]


def paged_attention_cases(run, smoke):
    """Decode attention at each (batch, context): lessonlib, its peers, and the knobs' sweep."""
    heads, kv_heads, head_dim, block_size = SMOKE_HEADS if smoke else (HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    for batch, context in SMOKE_CONTEXTS if smoke else CONTEXTS:
        case, paged, (truth, low), shape, nbytes = decode_case(batch, context, heads, kv_heads, head_dim, block_size,
                                                               run.dtype)
        yield case
        yield from flex_case(run, paged, truth, low, shape, nbytes)
        knobs = KNOBS[:2] if smoke else KNOBS
        yield Case(Op.PAGED_ATTENTION, shape, {sweep_label(kw): (lambda kw=kw: ops.paged_attention(
            *paged, validate=False, **kw)) for kw in knobs}, nbytes=nbytes, graphed=tuple(map(sweep_label, knobs)))
        del case, paged, truth, low


def flex_case(run, paged, truth, low, shape, nbytes):
    """FlexAttention's paged attention; a peer that does not run here is recorded with its error, not hidden."""
    try:
        flex = flex_paged_attention(*paged)
        check_close("FlexAttention paged", flex(), truth, low)
    except Exception as error:
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        run.record(Op.PAGED_ATTENTION, Impl.FLEX_PAGED, shape, None, error=message)
        return
    yield Case(Op.PAGED_ATTENTION, shape, {Impl.FLEX_PAGED: flex}, nbytes=nbytes, graphed=(Impl.FLEX_PAGED,))


def store_kv_case(run, smoke):
    """The cache's store_kv writing a prefill's K and V into shuffled slots, against a copy of the same bytes."""
    _, kv_heads, head_dim, block_size = SMOKE_HEADS if smoke else (HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    tokens = SMOKE_STORE_TOKENS if smoke else STORE_TOKENS
    k_new = torch.randn(tokens, kv_heads, head_dim, device=runtime.device(), dtype=torch.float32).to(run.dtype)
    v_new = torch.randn_like(k_new)
    num_blocks = -(-tokens // block_size) * 2
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=runtime.device(), dtype=run.dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=runtime.device())[:tokens]

    def check():
        ops.store_kv(k_new, v_new, k_cache, v_cache, slots)
        assert torch.equal(k_cache.reshape(-1, kv_heads, head_dim)[slots], k_new)

    nbytes = 2 * 2 * k_new.numel() * k_new.element_size()  # K and V, each read once and written once
    peers = {Impl.LESSONLIB: lambda: ops.store_kv(k_new, v_new, k_cache, v_cache, slots, validate=False),
             Impl.SLOTS_VALIDATED: lambda: ops.store_kv(k_new, v_new, k_cache, v_cache, slots),
             Impl.COPY: copy_call(nbytes)}
    shape = {"T": tokens, "Hkv": kv_heads, "D": head_dim, "block_size": block_size}
    return Case(Op.STORE_KV, shape, peers, check, nbytes, graphed=(Impl.LESSONLIB, Impl.COPY))


def rope_store_kv_case(run, tokens, head_dim, smoke):
    """ops.rope_store_kv against the kernels it replaces and plain PyTorch (lessonlib.cases.paged_attention)."""
    heads, kv_heads, _, block_size = SMOKE_HEADS if smoke else (HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    return cases.rope_store_kv_case(tokens, heads, kv_heads, head_dim, block_size, run.dtype)


def main():
    args = bench.parse_args(__doc__, "bench_paged_attention.py")
    run = bench.Run(Benchmark.PAGED_ATTENTION, smoke=args.smoke, check_only=args.check)
    warm_up_gpu()
    run.cases(paged_attention_cases(run, args.smoke))
    run.cases([store_kv_case(run, args.smoke)])
    run.cases(rope_store_kv_case(run, tokens, head_dim, args.smoke)
              for tokens, head_dim in (SMOKE_ROPE_STORE_KV_SHAPES if args.smoke else ROPE_STORE_KV_SHAPES))
    ceiling_bytes = 1 << (20 if args.smoke else 32)
    run.save(args.out, {"bandwidth_gbs": round(gbps(ceiling_bytes, time_copy(ceiling_bytes)), 1), "matmul_tflops": None})


if __name__ == "__main__":
    main()
