"""Lesson 05's benchmark: launch overhead, torch.compile and CUDA graphs, on the GatedMLP and on one decoder
layer's decode step over a paged KV cache.

    python benchmarks/bench_cuda_graphs.py --out lessonlib/results/cuda-graphs-h200.json

bf16. GatedMLP (hidden 4096, intermediate 14336) at T = 1, 8, 128, 2048: eager, torch.compile (default),
torch.compile(mode="reduce-overhead"), and the eager module captured by hand into a CUDA graph. Decoder layer
(Llama-3-8B shapes: 32 query heads, 8 KV heads, D=128) decode step at batch 1, 8, 64 and context 1024 and 8192: the plain
PyTorch step, lessonlib's fused step, and the fused step replayed from a CUDA graph (the plain step syncs with the
host, so it cannot be captured); the memory each graph's pool holds.
Every path is checked against the eager result first. ``--smoke`` runs tiny sizes in any mode (no graphs on CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lessonlib import reference, runtime  # noqa: E402
from lessonlib.decoder import DecoderLayer, next_token_inputs  # noqa: E402
from lessonlib.kv_cache import PagedKVCache  # noqa: E402
from lessonlib.measure import count_launches, time_fn, warm_up_gpu  # noqa: E402
from lessonlib.results import Results, environment  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any mode: tests this script")
    args = parser.parse_args()
    gpu = runtime.on_gpu()
    if not args.smoke and not gpu:
        sys.exit("bench_cuda_graphs.py needs a GPU (use --smoke to test the script on CPU)")
    device = runtime.device()
    dtype = runtime.dtype()  # bfloat16 where the GPU has it, float16 on a T4 and in the interpreter
    records, notes = [], {}
    warm_up_gpu()

    def record(op, impl, shape, us, **extra):
        records.append({"op": op, "impl": impl, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                        "us": round(us, 3), **extra})
        print(f"{op:14s} {impl:34s} {str(shape):44s} {us:10.2f} us {extra or ''}", flush=True)

    def same(name, got, want):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())

    hidden, inter = (64, 128) if args.smoke else (4096, 14336)
    mlp = reference.GatedMLP(hidden, inter, device=device, dtype=dtype)
    compiled = {"torch.compile": torch.compile(mlp), "torch.compile reduce-overhead": torch.compile(mlp, mode="reduce-overhead")} \
        if gpu else {}
    with torch.inference_mode():
        for tokens in ((1, 8) if args.smoke else (1, 8, 128, 2048)):
            x = torch.randn(tokens, hidden, device=device, dtype=dtype)
            want = mlp(x)
            shape = {"T": tokens, "H": hidden, "I": inter}
            record("gated_mlp", "eager", shape, time_fn(mlp, x).median_us)
            for name, fn in compiled.items():
                same(name, fn(x), want)
                record("gated_mlp", name, shape, time_fn(fn, x).median_us)
            if gpu:
                from lessonlib.cuda_graphs import Graphed

                graphed = Graphed(mlp, x.clone())
                same("graph", graphed(x), want)
                record("gated_mlp", "CUDA graph (by hand)", shape, time_fn(graphed, x).median_us,
                       pool_mb=round(graphed.pool_bytes / 2**20, 1))

    heads, kv_heads, head_dim = (4, 2, 16) if args.smoke else (32, 8, 128)
    layer = DecoderLayer(hidden, heads, kv_heads, head_dim, inter, device=device, dtype=dtype)
    block_size = 16
    for batch, context in ([(1, 40), (2, 40)] if args.smoke else [(1, 1024), (8, 1024), (64, 1024), (1, 8192), (8, 8192), (64, 8192)]):
        max_blocks = -(-(context + 64) // block_size)
        cache = PagedKVCache(batch * max_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        seqs = list(range(batch))
        for seq in seqs:
            cache.add_sequence(seq)
            cache.append(seq, torch.randn(context, kv_heads, head_dim, device=device, dtype=dtype),
                         torch.randn(context, kv_heads, head_dim, device=device, dtype=dtype))
        x = torch.randn(batch, hidden, device=device, dtype=dtype)
        inputs = next_token_inputs(cache, seqs, x, torch.zeros_like(x), max_blocks)
        shape = {"B": batch, "context": context, "H": hidden, "heads": heads, "kv_heads": kv_heads, "D": head_dim}
        with torch.inference_mode():
            want, _ = layer.step(inputs, cache.k_cache, cache.v_cache)
            got, _ = layer.fused_step(inputs, cache.k_cache, cache.v_cache)
            same("fused step", got, want)
            steps = {"eager PyTorch step": layer.step, "lessonlib fused step": layer.fused_step}
            for name, step in steps.items():
                launches = count_launches(step, inputs, cache.k_cache, cache.v_cache).total
                record("decode_step", name, shape, time_fn(step, inputs, cache.k_cache, cache.v_cache).median_us,
                       launches=launches)
            if gpu:
                from lessonlib.cuda_graphs import Graphed

                # Only the fused step is graph-safe: the plain step's reference.paged_attention reads each seq_len
                # on the host (int(seq_lens[b])), a device sync, which capture forbids.
                static = list(vars(inputs).values())

                def run(*tensors):
                    return layer.fused_step(type(inputs)(*tensors), cache.k_cache, cache.v_cache)

                graphed = Graphed(run, *[t.clone() for t in static])
                same("graphed fused step", graphed(*static)[0], want)
                record("decode_step", "lessonlib fused step, CUDA graph", shape, time_fn(graphed, *static).median_us,
                       pool_mb=round(graphed.pool_bytes / 2**20, 1),
                       launches=count_launches(graphed.graph.replay).total)  # the same kernels, one launch call
    results = Results("cuda_graphs", " ".join(["python", *sys.argv]), environment(), {}, records, notes)
    print("wrote", results.save(args.out))


if __name__ == "__main__":
    main()
