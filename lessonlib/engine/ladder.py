"""Lesson 07's tokens/s ladder: the same requests served by the engine with each course step switched on in turn
(:func:`lessonlib.engine.features.ladder`), every rung's tokens, wall time and step counts.

    runs = run_ladder(path, prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in ...],
                      dtype=torch.float32, max_num_seqs=32)
    runs[i].label, runs[i].tokens_per_s, runs[i].tokens

``benchmarks/bench_engine.py`` records it on the GPU; the notebook runs it live on the tiny model in the interpreter,
where the times mean little but every rung must give the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lessonlib import runtime
from lessonlib.engine.features import Features, ladder
from lessonlib.engine.llm import LLM
from lessonlib.engine.sequence import SamplingParams
from lessonlib.results import Impl


@dataclass
class RungRun:
    label: str  # the rung, an Impl label ("plain PyTorch", "+ fused ops", ...)
    features: Features
    tokens: list[list[int]]  # each request's output tokens, in the prompts' order
    seconds: float  # wall time of the timed generate() (GPU work synchronized)
    prefill_steps: int
    decode_steps: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    blocks_in_use: int  # after generate(): 0 unless blocks leaked

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def rungs_here() -> list[tuple[str, Features]]:
    """The ladder's rungs that differ on this machine: without a GPU, "+ CUDA graphs" runs eager, the rung below, and
    is left out (the asynchronous scheduling that comes with it then comes with the top rung)."""
    return [(label, f) for label, f in ladder() if runtime.on_gpu() or label != Impl.RUNG_CUDA_GRAPHS]


def _sync():
    if runtime.on_gpu():
        torch.cuda.synchronize()


def run_rung(llm: LLM, prompts, params: list[SamplingParams], label: str, warm_up=None) -> RungRun:
    """``warm_up`` (prompts, params), if given, runs first and untimed: Triton compiles each kernel at its first
    call, which the timed run must not pay; then its first prompt alone, which captures that length's prefill graph
    (a request admitted alone is prefilled from it)."""
    if warm_up is not None:
        llm.generate(*warm_up)
        llm.generate(warm_up[0][:1], warm_up[1])
    _sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync()
    seconds = time.perf_counter() - start
    return RungRun(label, llm.features, [o.outputs[0].token_ids for o in outs], seconds,
                   sum(s.kind == "prefill" for s in llm.steps), sum(s.kind == "decode" for s in llm.steps),
                   sum(s.cached_tokens for s in llm.steps), llm.num_blocks_in_use())


def run_ladder(path, prompts, params: list[SamplingParams], rungs=None, warm_up=None, progress: bool = False,
               **engine) -> list[RungRun]:
    """Every rung (default :func:`rungs_here`) on a fresh engine (``engine``: LLM's keyword arguments), one after
    the other; each engine is freed before the next is built. ``progress``: a line per rung as it ends."""
    runs = []
    for label, features in rungs or rungs_here():
        llm = LLM(path, features=features, **engine)
        runs.append(run_rung(llm, prompts, params, label, warm_up))
        if progress:
            print(f"{label:28s} {runs[-1].output_tokens} tokens in {runs[-1].seconds:.2f} s, "
                  f"{runs[-1].decode_steps} decode steps", flush=True)
        del llm
        if runtime.on_gpu():
            torch.cuda.empty_cache()
    return runs
