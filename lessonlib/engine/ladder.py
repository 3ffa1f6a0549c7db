"""Lesson 07's tokens/s ladder: the same requests served by the engine with each course step switched on in turn
(:func:`lessonlib.engine.features.ladder`), every rung's tokens, wall time and step counts.

    runs = run_ladder(path, prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in ...],
                      dtype=torch.float32, max_num_seqs=32, repeats=3, gpu_time=True)
    runs[i].label, runs[i].tokens_per_s, runs[i].tokens_per_s_range, runs[i].gpu_us_per_step, runs[i].tokens

A rung's wall time moves from run to run with the host (the eager rungs launch every kernel from Python), so each
rung runs ``repeats`` times on the same engine: its time is the median, its spread the fastest and slowest run,
and a gain between two rungs is read only where their spreads do not overlap. ``gpu_time`` adds one more run
under torch.profiler: the seconds the GPU spent in kernels (:func:`lessonlib.measure.gpu_busy_seconds`), which the
host's noise does not move, so a kernel's gain shows even where the host's time hides it in the wall clock.

``benchmarks/bench_engine.py`` records it on the GPU; the notebook runs it live on the tiny model in the interpreter,
where the times mean little but every rung must give the same tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from lessonlib import runtime
from lessonlib.measure import gpu_busy_seconds
from lessonlib.engine.features import Features, ladder
from lessonlib.engine.llm import LLM
from lessonlib.engine.sequence import SamplingParams
from lessonlib.results import Impl


@dataclass
class RungRun:
    label: str  # the rung, an Impl label ("plain PyTorch", "+ fused ops", ...)
    features: Features
    tokens: list[list[int]]  # each request's output tokens, in the prompts' order
    seconds: float  # wall time of the timed generate() (GPU work synchronized): the median over seconds_runs
    prefill_steps: int
    decode_steps: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    blocks_in_use: int  # after generate(): 0 unless blocks leaked
    seconds_runs: tuple[float, ...] = ()  # every timed run's wall time (empty: one run, ``seconds``)
    gpu_seconds: float | None = None  # kernel time of one more run, under the profiler (None: not measured)
    repeats_same_tokens: int = 0  # the repeats after the first that gave the first run's tokens

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tokens_per_s_range(self) -> tuple[float, float]:
        """(slowest, fastest) run's tokens/s."""
        runs = self.seconds_runs or (self.seconds,)
        return self.output_tokens / max(runs), self.output_tokens / min(runs)

    @property
    def steps(self) -> int:
        return self.prefill_steps + self.decode_steps

    @property
    def gpu_us_per_step(self) -> float | None:
        return None if self.gpu_seconds is None else 1e6 * self.gpu_seconds / self.steps


def rungs_here() -> list[tuple[str, Features]]:
    """The ladder's rungs that differ on this machine: without a GPU, "+ CUDA graphs" runs eager, the rung below, and
    is left out (the asynchronous scheduling that comes with it then comes with the top rung)."""
    return [(label, f) for label, f in ladder() if runtime.on_gpu() or label != Impl.RUNG_CUDA_GRAPHS]


def _sync():
    if runtime.on_gpu():
        torch.cuda.synchronize()


def run_rung(llm: LLM, prompts, params: list[SamplingParams], label: str, warm_up=None, repeats: int = 1,
             gpu_time: bool = False) -> RungRun:
    """``warm_up`` (prompts, params), if given, runs first and untimed: Triton compiles each kernel at its first
    call, which the timed run must not pay; then its first prompt alone, which captures that length's prefill graph
    (a request admitted alone is prefilled from it). Then ``repeats`` timed runs of the same requests and, with
    ``gpu_time`` on a GPU, one under the profiler. The tokens are the first run's; ``repeats_same_tokens`` counts
    the repeats that gave the same (the same requests, so every one should: fewer says the kernels are not
    deterministic, and the runs' work may differ)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if warm_up is not None:
        llm.generate(*warm_up)
        llm.generate(warm_up[0][:1], warm_up[1])
    tokens, seconds, same = None, [], 0
    for _ in range(repeats):
        llm.block_manager.forget_prefix_cache()  # a repeat must not find the run before's prompts cached
        _sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync()
        seconds.append(time.perf_counter() - start)
        got = [o.outputs[0].token_ids for o in outs]
        same += got == tokens
        if tokens is None:
            tokens = got
    steps = list(llm.steps)  # the last timed run's (the profiled run below replaces llm.steps)
    gpu_seconds = profiled_gpu_seconds(llm, prompts, params) if gpu_time and runtime.on_gpu() else None
    return RungRun(label, llm.features, tokens, statistics.median(seconds),
                   sum(s.kind == "prefill" for s in steps), sum(s.kind == "decode" for s in steps),
                   sum(s.cached_tokens for s in steps), llm.num_blocks_in_use(), tuple(seconds), gpu_seconds, same)


PROFILED_STEPS = 100  # engine steps per profiler session (below)


def profiled_gpu_seconds(llm: LLM, prompts, params) -> float | None:
    """The GPU's kernel time over one more run of the same requests, the profiler stopped and restarted every
    PROFILED_STEPS steps: an eager run of a thousand steps launches half a million kernels, more records than one
    profiler session keeps (kineto stops collecting past its buffer limit, and the sum would come out short).
    None without a GPU (the run is then wasted: :func:`run_rung` calls this on a GPU only)."""
    llm.block_manager.forget_prefix_cache()
    params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    llm.steps = []
    for prompt, sampling in zip(prompts, params):
        llm.add_request(prompt, sampling)

    def window():
        for _ in range(PROFILED_STEPS):
            if not llm.has_unfinished_requests():
                return
            llm.step()

    total = 0.0
    while llm.has_unfinished_requests():
        total += gpu_busy_seconds(window)[1] or 0.0
    return total or None


def run_ladder(path, prompts, params: list[SamplingParams], rungs=None, warm_up=None, progress: bool = False,
               repeats: int = 1, gpu_time: bool = False, **engine) -> list[RungRun]:
    """Every rung (default :func:`rungs_here`) on a fresh engine (``engine``: LLM's keyword arguments), one after
    the other, each run ``repeats`` times (and once under the profiler with ``gpu_time``: :func:`run_rung`); each
    engine is freed before the next is built. ``progress``: a line per rung as it ends."""
    runs = []
    for label, features in rungs or rungs_here():
        llm = LLM(path, features=features, **engine)
        runs.append(run_rung(llm, prompts, params, label, warm_up, repeats, gpu_time))
        if progress:
            r = runs[-1]
            gpu = "" if r.gpu_us_per_step is None else f", GPU {r.gpu_us_per_step:,.0f} us per step"
            print(f"{label:28s} {r.output_tokens} tokens in {r.seconds:.2f} s (median of "
                  f"{', '.join(f'{s:.2f}' for s in r.seconds_runs)}), {r.decode_steps} decode steps{gpu}", flush=True)
        del llm
        if runtime.on_gpu():
            torch.cuda.empty_cache()
    return runs
