"""Capturing work into a CUDA graph by hand, for lesson 05: static inputs, one capture, replays.

A CUDA graph records the kernels a piece of code launches, with their arguments (pointers included), once; a replay
launches them all with one call, no Python, no per-kernel launch cost. What makes it work is also what limits it:
every replay reads the *same* input addresses and writes the same output addresses, so new inputs are copied into
the static buffers first, shapes cannot change, and nothing inside may synchronise with the host or allocate
outside the graph's memory pool.
"""

from __future__ import annotations

import torch


class Graphed:
    """``fn(*static_inputs)`` captured once; calling it copies new inputs into the static buffers
    and replays.

        graphed = Graphed(step, *static_tensors)
        # same shapes and dtypes; returns the graph's static outputs (overwritten next call)
        out = graphed(*new_tensors)
    """

    def __init__(self, fn, *static_inputs: torch.Tensor, warmup: int = 3):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA GPU")
        self.fn, self.static_inputs = fn, static_inputs
        # warm up on a side stream, as PyTorch's docs prescribe (lazy init, autotuning)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # torch.cuda.graph() empties the cache on entry: do it first, so `before` is honest
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*static_inputs)
        torch.cuda.synchronize()
        # memory the graph's private pool holds
        self.pool_bytes = torch.cuda.memory_reserved() - before

    def __call__(self, *inputs: torch.Tensor):
        for static, new in zip(self.static_inputs, inputs):
            if new is not static:
                static.copy_(new)
        self.graph.replay()
        return self.outputs


def launch_modes(module):
    """Lesson 05's four ways to launch the same ``module``: eager, torch.compile, torch.compile's reduce-overhead
    mode and a CUDA graph captured by hand. Returns ``modes(x) -> {impl: call}`` for inputs shaped like ``x`` (a
    graph is captured per shape; the compiled modules are made once). Without a GPU: eager alone (no graphs, and
    torch.compile's speed is lesson 04's). benchmarks/bench_cuda_graphs.py and notebook 05 both time these."""
    from lessonlib import runtime
    from lessonlib.results import Impl

    if not runtime.on_gpu():
        return lambda x: {Impl.EAGER: module}
    compiled = {Impl.COMPILE: torch.compile(module),
                Impl.COMPILE_REDUCE_OVERHEAD: torch.compile(module, mode="reduce-overhead")}
    return lambda x: {Impl.EAGER: module, **compiled, Impl.CUDA_GRAPH_BY_HAND: Graphed(module, x.clone())}
