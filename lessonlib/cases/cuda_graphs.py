"""Lesson 05's timed decode step, shared by ``benchmarks/bench_cuda_graphs.py`` (the recorded run) and the
notebook's "measure on this GPU" view (:mod:`lessonlib.widgets.recorded`): one decoder layer's decode step, plain
PyTorch, lessonlib's fused kernels and the fused step replayed from a CUDA graph, each checked against the plain
step first, with its kernel launches per step counted by torch.profiler.
"""

from __future__ import annotations

import torch

from lessonlib import runtime
from lessonlib.bench import Case
from lessonlib.cuda_graphs import Graphed
from lessonlib.decoder import next_token_inputs
from lessonlib.kv_cache import PagedKVCache
from lessonlib.measure import count_launches
from lessonlib.results import Impl, Op

BLOCK_SIZE = 16


def same(name, got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item(), msg=name)


def pool_mb(fn) -> dict:
    return {"pool_mb": round(fn.pool_bytes / 2**20, 1)} if isinstance(fn, Graphed) else {}


def decode_step_cases(run, layer, hidden, heads, shapes):
    """One decoder layer's decode step: plain PyTorch, lessonlib's fused kernels, the fused step graph-replayed."""
    heads, kv_heads, head_dim = heads
    for batch, context in shapes:
        max_blocks = -(-(context + 64) // BLOCK_SIZE)
        cache = PagedKVCache(batch * max_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=run.dtype,
                             device=runtime.device())
        seqs = list(range(batch))
        for seq in seqs:
            cache.add_sequence(seq)
            cache.append(seq, torch.randn(context, kv_heads, head_dim, device=runtime.device(), dtype=run.dtype),
                         torch.randn(context, kv_heads, head_dim, device=runtime.device(), dtype=run.dtype))
        x = torch.randn(batch, hidden, device=runtime.device(), dtype=run.dtype)
        inputs = next_token_inputs(cache, seqs, x, torch.zeros_like(x), max_blocks)
        shape = {"B": batch, "context": context, "H": hidden, "heads": heads, "kv_heads": kv_heads, "D": head_dim}
        want, _ = layer.step(inputs, cache.k_cache, cache.v_cache)
        for impl, step in {Impl.EAGER_STEP: layer.step, Impl.FUSED_STEP: layer.fused_step}.items():
            yield Case(Op.DECODE_STEP, shape, {impl: lambda step=step: step(inputs, cache.k_cache, cache.v_cache)},
                       lambda step=step, impl=impl: same(impl, step(inputs, cache.k_cache, cache.v_cache)[0], want),
                       fields={"launches": count_launches(step, inputs, cache.k_cache, cache.v_cache).total})
        if runtime.on_gpu():
            # Only the fused step is graph-safe: the plain step's reference.paged_attention reads each seq_len
            # on the host (int(seq_lens[b])), a device sync, which capture forbids.
            static = list(vars(inputs).values())
            graphed = Graphed(lambda *t: layer.fused_step(type(inputs)(*t), cache.k_cache, cache.v_cache),
                              *[t.clone() for t in static])
            yield Case(Op.DECODE_STEP, shape, {Impl.FUSED_STEP_GRAPH: lambda: graphed(*static)},
                       lambda: same("graphed fused step", graphed(*static)[0], want),
                       fields={**pool_mb(graphed),  # the same kernels, one launch call:
                               "launches": count_launches(graphed.graph.replay).total})


# The decoder layer's intermediate size by its hidden size: Llama-3-8B's (the recorded run), and the smoke run's.
LAYER_SIZES, SMOKE_LAYER_SIZES = (4096, 14336), (64, 128)
LAYER_INTERMEDIATE = dict([LAYER_SIZES, SMOKE_LAYER_SIZES])
