"""What lesson 07 runs on its engine, shared by ``benchmarks/bench_engine.py`` and the notebook: the tokens/s ladder
(the same requests served by the engine with each course step switched on in turn, :func:`ladder`), every rung's
tokens, wall time and step counts; the scheduler under a stream of arriving requests (:func:`simulate`); and the
live ladder's check against transformers' tokens (:func:`show_live_ladder`). The engine is the one under test here:
whole runs, not :class:`lessonlib.bench.Case` timings of one call.

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

import random
import statistics
import time
from dataclasses import dataclass, replace

import torch

from lessonlib import runtime
from lessonlib.engine.block_manager import BlockManager
from lessonlib.engine.features import PLAIN_PYTORCH, Features
from lessonlib.engine.llm import LLM
from lessonlib.engine.scheduler import Scheduler
from lessonlib.engine.sequence import SamplingParams, Sequence
from lessonlib.measure import gpu_busy_seconds
from lessonlib.results import Impl
from lessonlib.serving.greedy_parity import first_difference, near_tie_gap


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


def ladder() -> list[tuple[str, Features]]:
    """The rungs, cumulative in the course's order: plain PyTorch, then each lesson's step switched on in turn."""
    rungs, features = [(Impl.RUNG_PLAIN, PLAIN_PYTORCH)], PLAIN_PYTORCH
    for names, label in ((("fused_ops", "gemv"), Impl.RUNG_FUSED_OPS), (("flash_prefill",), Impl.RUNG_FLASH_PREFILL),
                         (("paged_decode",), Impl.RUNG_PAGED_DECODE),
                         (("cuda_graphs", "async_scheduling"), Impl.RUNG_CUDA_GRAPHS),
                         (("continuous_batching",), Impl.RUNG_CONTINUOUS_BATCHING)):
        features = replace(features, **dict.fromkeys(names, True))
        rungs.append((label, features))
    return rungs


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


@dataclass
class SimulatedStep:
    step: int
    kind: str
    running: int
    waiting: int
    blocks_used: int
    blocks_reserved: int  # what a server reserving each running request's maximum length up front would hold
    preemptions: int
    cached_tokens: int  # prompt tokens served from the prefix cache, so far


def simulate(arrival_rate: float = 0.5, block_size: int = 16, num_blocks: int = 256, steps: int = 400,
             max_num_seqs: int = 32, shared_prefix: int = 64, seed: int = 0) -> list[SimulatedStep]:
    """Requests arrive at ``arrival_rate`` per step (Poisson); prompts of 16-256 tokens, half of them opening with
    the same ``shared_prefix``-token system prompt; each asks for up to 256 new tokens and stops after a random
    number of them (as an end-of-sequence token would). The real Scheduler and BlockManager run; the model is
    replaced by "append a token"."""
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(blocks, max_num_seqs, max_num_batched_tokens=4096)
    system = [rng.randrange(1000) for _ in range(shared_prefix)]
    stops: dict[int, int] = {}
    records, cached, next_arrival = [], 0, rng.expovariate(arrival_rate) if arrival_rate > 0 else float("inf")
    for step in range(steps):
        while next_arrival <= step:
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(16, 256))]
            if rng.random() < 0.5:
                prompt = system + prompt
            seq = Sequence(prompt[: num_blocks * block_size // 2], SamplingParams(max_tokens=256))
            stops[seq.seq_id] = rng.randrange(1, 257)
            scheduler.add(seq)
            next_arrival += rng.expovariate(arrival_rate)
        seqs, is_prefill = scheduler.schedule() if not scheduler.is_finished() else ([], False)
        if is_prefill:
            cached += sum(seq.num_cached_tokens for seq in seqs)
        for seq in seqs:
            seq.token_ids.append(rng.randrange(1000))
            if not is_prefill:
                blocks.register_written(seq, len(seq.token_ids) - 2)  # the fed token's block, once full, is cached
            if seq.num_output_tokens >= stops[seq.seq_id]:
                scheduler.finish(seq, "stop")
        reserved = sum(blocks.blocks_for(seq.num_prompt_tokens + seq.params.max_tokens) for seq in scheduler.running)
        records.append(SimulatedStep(step, "prefill" if is_prefill else ("decode" if seqs else "idle"),
                                     len(scheduler.running), len(scheduler.waiting), blocks.num_used, reserved,
                                     scheduler.num_preemptions, cached))
    return records


def show_live_ladder(runs, expected: list[list[int]], *, model_path=None, prompts=None, dtype=None) -> None:
    """A live ladder's table (:func:`run_ladder`); raises if a rung left blocks in use or if its
    tokens differ from ``expected`` (transformers' greedy tokens in the engine's dtype, one list per request).

    In float32 (the interpreter) every rung must give ``expected`` exactly. In 16 bits (``dtype``, with
    ``model_path`` and the text ``prompts``) a rung may part from it at a **near-tie**
    (:func:`lessonlib.serving.greedy_parity.near_tie_gap`): where the two first part, the float64 logits of their two
    tokens differ by no more than the 16-bit rounding allows there, and one of them is within that of the float64
    best. Each summation order rounds differently, and random-ish weights give close calls; any wider gap is a wrong
    token and raises. transformers' models are loaded only if some rung parts."""
    sixteen_bits = dtype in (torch.float16, torch.bfloat16)
    if sixteen_bits and (model_path is None or prompts is None):
        raise ValueError("show_live_ladder: in 16 bits it needs model_path and prompts to judge near-ties")
    judge = None
    print(f"{'rung':28s} {'tokens':>6s} {'seconds':>8s} {'decode steps':>12s}  same tokens as transformers")
    for run in runs:
        if len(run.tokens) != len(expected):
            raise AssertionError(f"rung {run.label!r}: {len(run.tokens)} requests' tokens for {len(expected)} requests")
        notes = []
        for i, (got, want) in enumerate(zip(run.tokens, expected)):
            at = first_difference(got, want)
            if at is None:
                continue
            differs = f"rung {run.label!r}: request {i}'s tokens {got} against {want}"
            if not sixteen_bits or at >= min(len(got), len(want)):  # float32, or a different length: no near-tie
                raise AssertionError(differs)
            judge = judge or _NearTieJudge(model_path, prompts, dtype)
            gap, allowed = judge(i, want[:at], got[at], want[at])
            if gap > allowed:
                raise AssertionError(f"{differs}: a float64 logit gap of {gap:.3g} at token {at}, more than the "
                                     f"{allowed:.3g} 16-bit rounding allows")
            notes.append(f"request {i} parts at token {at}, a near-tie (gap {gap:.3f} <= {allowed:.3f})")
        print(f"{run.label:28s} {run.output_tokens:6d} {run.seconds:8.2f} {run.decode_steps:12d}  "
              f"{'yes' if not notes else '; '.join(notes)}")
        if run.blocks_in_use:
            raise AssertionError(f"rung {run.label!r}: {run.blocks_in_use} blocks left in use after generate")


class _NearTieJudge:
    """transformers' logits in float64 (the truth) and in the engine's 16-bit dtype for a request's context."""

    def __init__(self, model_path, prompts, dtype):
        from lessonlib.serving.greedy_parity import _hf_model

        self.tokenizer, self.truth = _hf_model(str(model_path), torch.float64)
        self.low = _hf_model(str(model_path), dtype)[1]
        self.prompts, self.dtype = prompts, dtype

    def __call__(self, request: int, generated: list[int], a: int, b: int) -> tuple[float, float]:
        """(gap, allowed) where request ``request`` parts after ``generated``: :func:`near_tie_gap`."""
        ids = torch.tensor([self.tokenizer(self.prompts[request]).input_ids + list(generated)],
                           device=self.truth.device)
        with torch.inference_mode():
            return near_tie_gap(self.truth(ids).logits[0, -1], self.low(ids).logits[0, -1], a, b, self.dtype)
