"""Lesson 05's benchmark: launch overhead, torch.compile and CUDA graphs, on the GatedMLP and on one decoder
layer's decode step over a paged KV cache.

    python -m benchmarks.bench_cuda_graphs --out lessonlib/results/cuda-graphs-h200.json

bf16. GatedMLP (hidden 4096, intermediate 14336) at T = 1, 8, 128, 2048: eager, torch.compile (default),
torch.compile(mode="reduce-overhead"), and the eager module captured by hand into a CUDA graph. Decoder layer
(Llama-3-8B shapes: 32 query heads, 8 KV heads, D=128) decode step at batch 1, 8, 64 and context 1024 and 8192: the plain
PyTorch step, lessonlib's fused step, and the fused step replayed from a CUDA graph (the plain step syncs with the
host, so it cannot be captured); the memory each graph's pool holds.
Every path is checked against the eager result first. ``--smoke`` runs tiny sizes in any mode (no graphs on CPU).
"""

from __future__ import annotations

import torch

from lessonlib import bench, reference, runtime
from lessonlib.bench import Case
from lessonlib.cases.cuda_graphs import LAYER_SIZES, SMOKE_LAYER_SIZES, decode_step_cases, pool_mb, same
from lessonlib.cuda_graphs import launch_modes
from lessonlib.decoder import DecoderLayer
from lessonlib.measure import warm_up_gpu
from lessonlib.results import Benchmark, Op

MLP_SIZES, SMOKE_MLP_SIZES = LAYER_SIZES, SMOKE_LAYER_SIZES  # hidden, intermediate
MLP_TOKENS, SMOKE_MLP_TOKENS = (1, 8, 128, 2048), (1, 8)
HEADS, SMOKE_HEADS = (32, 8, 128), (4, 2, 16)  # query heads, KV heads, head_dim
STEP_SHAPES = [(1, 1024), (8, 1024), (64, 1024), (1, 8192), (8, 8192), (64, 8192)]  # (batch, context)
SMOKE_STEP_SHAPES = [(1, 40), (2, 40)]


def gated_mlp_cases(run, mlp, hidden, inter, token_counts):
    """The GatedMLP launched each of lesson 05's four ways (cuda_graphs.launch_modes), each checked against eager."""
    modes = launch_modes(mlp)
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device=runtime.device(), dtype=run.dtype)
        want = mlp(x)
        for impl, fn in modes(x).items():
            yield Case(Op.GATED_MLP, {"T": tokens, "H": hidden, "I": inter}, {impl: lambda fn=fn: fn(x)},
                       lambda fn=fn, impl=impl: same(impl, fn(x), want), fields=pool_mb(fn))


def main():
    args = bench.parse_args(__doc__, "bench_cuda_graphs.py")
    smoke = args.smoke
    run = bench.Run(Benchmark.CUDA_GRAPHS, smoke=smoke, check_only=args.check)
    warm_up_gpu()
    hidden, inter = SMOKE_MLP_SIZES if smoke else MLP_SIZES
    mlp = reference.GatedMLP(hidden, inter, device=runtime.device(), dtype=run.dtype)
    heads = SMOKE_HEADS if smoke else HEADS
    layer = DecoderLayer(hidden, *heads, inter, device=runtime.device(), dtype=run.dtype)
    with torch.inference_mode():
        run.cases(gated_mlp_cases(run, mlp, hidden, inter, SMOKE_MLP_TOKENS if smoke else MLP_TOKENS))
        run.cases(decode_step_cases(run, layer, hidden, heads, SMOKE_STEP_SHAPES if smoke else STEP_SHAPES))
    run.save(args.out, {})


if __name__ == "__main__":
    main()
