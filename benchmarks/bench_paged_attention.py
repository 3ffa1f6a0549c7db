"""Lesson 03's benchmark: decode attention through a paged KV cache, against SDPA on a contiguous cache.

    python benchmarks/bench_paged_attention.py --out lessonlib/results/paged-attention-h200.json

bf16, 32 query heads over 8 KV heads, head_dim 128, block_size 16; GB/s counts the K and V bytes each call must
read. Peers measured in the same run: SDPA on a contiguous cache (the same K/V, laid out densely), and gather the
pages then SDPA. Also: the cache's store_kv kernel writing a 4096-token prefill, against a copy of the same bytes.
Every case is checked against the float64 reference first. ``--smoke`` runs tiny sizes in any mode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lessonlib import ops, reference, runtime  # noqa: E402
from lessonlib.flex_paged import flex_paged_attention  # noqa: E402
from lessonlib.measure import gbps, time_copy, time_fn, time_graph, warm_up_gpu  # noqa: E402
from lessonlib.results import Results, environment  # noqa: E402
from lessonlib.testing import check_close, to_float64  # noqa: E402


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any mode: tests this script")
    args = parser.parse_args()
    if not args.smoke and not runtime.on_gpu():
        sys.exit("bench_paged_attention.py needs a GPU (use --smoke to test the script on CPU)")
    dtype = runtime.dtype()  # bfloat16 where the GPU has it, float16 on a T4 and in the interpreter
    heads, kv_heads, head_dim, block_size = (8, 2, 32, 16) if args.smoke else (32, 8, 128, 16)
    cases = [(2, 64), (1, 100)] if args.smoke else [(32, 4096), (64, 2048), (8, 16384), (1, 32768)]
    records = []
    warm_up_gpu()

    def measure(op, impl, shape, fn, nbytes, capturable=True):
        """Two times per call: from Python (time_fn: what a plain decode loop pays, host included) and replayed
        from a CUDA graph (time_graph: the GPU's time alone, what a graph-captured decode step pays)."""
        us = time_fn(fn).median_us
        graph_us = time_graph(fn).median_us if runtime.on_gpu() and capturable else None
        rec = {"op": op, "impl": impl, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "us": round(us, 3),
               "bytes": nbytes, "gbps": round(nbytes / (us * 1e-6) / 1e9, 1),
               "graph_us": None if graph_us is None else round(graph_us, 3),
               "graph_gbps": None if graph_us is None else round(nbytes / (graph_us * 1e-6) / 1e9, 1)}
        records.append(rec)
        graph = "" if graph_us is None else f"   graph {graph_us:8.2f} us {rec['graph_gbps']:6.0f} GB/s"
        print(f"{op:16s} {impl:40s} {str(shape):34s} {us:8.2f} us {rec['gbps']:6.0f} GB/s{graph}", flush=True)

    for batch, context in cases:
        q, k_cache, v_cache, table, lens = build(batch, context, heads, kv_heads, head_dim, block_size, dtype)
        truth = reference.paged_attention(*to_float64(q, k_cache, v_cache), table, lens)
        low = reference.paged_attention(q, k_cache, v_cache, table, lens)
        check_close("paged_attention", ops.paged_attention(q, k_cache, v_cache, table, lens), truth, low)
        k, v = gather(k_cache, table, context).contiguous(), gather(v_cache, table, context).contiguous()
        nbytes = 2 * batch * context * kv_heads * head_dim * k.element_size()
        shape = {"B": batch, "context": context, "H": heads, "Hkv": kv_heads, "D": head_dim, "block_size": block_size}
        # The kernels with validate=False; the table checks cost a device sync per call (timed separately, and
        # a sync cannot be graph-captured).
        measure("paged_attention", "lessonlib", shape,
                lambda: ops.paged_attention(q, k_cache, v_cache, table, lens, validate=False), nbytes)
        measure("paged_attention", "lessonlib, tables validated every call", shape,
                lambda: ops.paged_attention(q, k_cache, v_cache, table, lens), nbytes, capturable=False)
        measure("paged_attention", "SDPA, contiguous cache", shape, lambda: sdpa(q, k, v), nbytes)
        measure("paged_attention", "gather pages, then SDPA", shape,
                lambda: sdpa(q, gather(k_cache, table, context), gather(v_cache, table, context)), nbytes)
        try:
            flex = flex_paged_attention(q, k_cache, v_cache, table, lens)
            check_close("FlexAttention paged", flex(), truth, low)
            measure("paged_attention", "FlexAttention paged", shape, flex, nbytes)
        except Exception as error:  # a peer that does not run here is recorded with its error, not hidden
            message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
            records.append({"op": "paged_attention", "impl": "FlexAttention paged", "shape": shape,
                            "dtype": str(dtype).removeprefix("torch."), "us": None, "error": message})
            print("FlexAttention paged:", message, flush=True)
        variants = [{"num_splits": s} for s in (1, 2, 4, 8, 16, 32, 64)] + [
            {"blocks_per_step": bps, "num_warps": w, "num_stages": st}
            for bps in (2, 4, 8) for w in (4, 8) for st in (2, 3, 4)] + [
            {"num_splits": s, "blocks_per_step": 8, "num_warps": 8} for s in (8, 16, 32, 64)]
        variants = variants[:2] if args.smoke else variants
        for knobs in variants:
            label = "lessonlib " + " ".join(f"{k}={v}" for k, v in knobs.items())
            measure("paged_attention", label, shape,
                    lambda kw=knobs: ops.paged_attention(q, k_cache, v_cache, table, lens, validate=False, **kw), nbytes)
        del q, k_cache, v_cache, k, v

    tokens = 64 if args.smoke else 4096
    k_new = torch.randn(tokens, kv_heads, head_dim, device=runtime.device(), dtype=torch.float32).to(dtype)
    v_new = torch.randn_like(k_new)
    num_blocks = -(-tokens // block_size) * 2
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=runtime.device(), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=runtime.device())[:tokens]
    ops.store_kv(k_new, v_new, k_cache, v_cache, slots)
    assert torch.equal(k_cache.reshape(-1, kv_heads, head_dim)[slots], k_new)
    nbytes = 2 * 2 * k_new.numel() * k_new.element_size()  # K and V, each read once and written once
    shape = {"T": tokens, "Hkv": kv_heads, "D": head_dim, "block_size": block_size}
    measure("store_kv", "lessonlib", shape, lambda: ops.store_kv(k_new, v_new, k_cache, v_cache, slots, validate=False),
            nbytes)
    measure("store_kv", "lessonlib, slots validated every call", shape,
            lambda: ops.store_kv(k_new, v_new, k_cache, v_cache, slots), nbytes, capturable=False)
    src = torch.empty(nbytes // 4, dtype=torch.float16, device=runtime.device()).normal_()
    dst = torch.empty_like(src)
    measure("store_kv", "copy (same bytes)", shape, lambda: dst.copy_(src), nbytes)

    ceiling_bytes = 1 << (20 if args.smoke else 32)
    ceilings = {"bandwidth_gbs": round(gbps(ceiling_bytes, time_copy(ceiling_bytes)), 1), "matmul_tflops": None}
    results = Results("paged_attention", " ".join(["python", *sys.argv]), environment(), ceilings, records, {})
    print("wrote", results.save(args.out))


if __name__ == "__main__":
    main()
