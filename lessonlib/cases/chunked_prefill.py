"""One long prompt arriving among running decodes, with and without chunked prefill (lesson 07): each engine step's
wall time and which requests' tokens came out of it.

The workload: ``decodes`` requests with short prompts are decoding when a request with a ``prompt``-token prompt
arrives. Prefill-first (``Features.chunked_prefill`` off) admits it at the next step and runs its whole prompt in
that step, alone: every running decode waits for it. Chunked prefill packs the decodes first and cuts the prompt into
chunks of what is left of the step's token budget (``max_num_batched_tokens``), so the decodes keep getting a token
every step, each step a little longer, and the prompt's first token comes a few steps later.

A token *comes out* of a step when the host has it at the step's end (with asynchronous scheduling, a decode step's
tokens come out one ``step()`` call later). The timeline starts when the long prompt arrives. Each request's
inter-token gaps (ITL) are the times between its tokens' arrivals; the long prompt's time to first token (TTFT)
runs from its arrival to its first token's.

    python -m benchmarks.bench_chunked_prefill --out lessonlib/results/chunked-prefill-h200.json
    python -m benchmarks.bench_chunked_prefill --smoke --out lessonlib/results/chunked-prefill-cpu.json

Without a GPU the engine runs its plain-PyTorch features (the interpreter's per-kernel cost would drown the
tokens' cost, which is what chunking moves around), on ``CPU_MODEL``, a small Llama that makes a long prompt's
prefill clearly longer than a decode step.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

from lessonlib import runtime
from lessonlib.results import Impl, Op, Results

# Full size (the GPU, a Llama-3.2-1B-shaped model): issue 26's case, 32 decodes and a 4,096-token prompt, with vLLM's
# 512-token budget of its latency-minded settings. Smoke (any mode): 4 decodes, a 384-token prompt, a 64-token budget.
FULL = dict(decodes=32, decode_prompt=32, prompt=4096, budget=512, warm_steps=3, after=3)
SMOKE = dict(decodes=4, decode_prompt=8, prompt=384, budget=64, warm_steps=3, after=3)
CPU_MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, vocab_size=1024, tie_word_embeddings=True)
MODES = {Impl.PREFILL_FIRST: False, Impl.CHUNKED_PREFILL: True}
ITL_P99_TARGET = 0.5  # issue 26: the running decodes' p99 gap, chunked, at most half of prefill-first's


def known_tokens(seq) -> int:
    """A request's generated tokens that have reached the host (not a placeholder of a step still running)."""
    from lessonlib.engine.llm import PENDING

    return sum(token != PENDING for token in seq.output_token_ids)


def timeline(llm, decode_prompts: list[list[int]], prompt: list[int], warm_steps: int, after: int) -> list[dict]:
    """Start the decodes, step ``warm_steps`` times once all are decoding, add the long prompt, then step until it
    has ``after`` tokens; each step's ``end`` (seconds since the prompt arrived), ``seconds`` and ``tokens`` (new
    tokens per request: the decodes in order, the long prompt last). The decodes are left running: use a fresh
    engine per timeline."""
    from lessonlib.engine import SamplingParams

    steps_needed = warm_steps + len(prompt) + after + 8  # more than any schedule of the window takes
    decode = SamplingParams(temperature=0.0, max_tokens=steps_needed, ignore_eos=True)
    seqs = [llm.add_request({"prompt_token_ids": p}, decode) for p in decode_prompts]
    while min(known_tokens(s) for s in seqs) == 0:
        llm.step()
    for _ in range(warm_steps):
        llm.step()
    long = llm.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=after,
                                                                        ignore_eos=True))
    seqs.append(long)
    arrived, steps = time.perf_counter(), []
    while known_tokens(long) < after:
        if len(steps) == steps_needed or long.finish_reason == "abort":
            raise RuntimeError(f"the long prompt has {known_tokens(long)} of {after} tokens after {len(steps)} steps "
                               f"(finish reason {long.finish_reason})")
        before = [known_tokens(s) for s in seqs]
        started = time.perf_counter()
        llm.step()
        end = time.perf_counter()
        steps.append({"end": round(end - arrived, 6), "seconds": round(end - started, 6),
                      "tokens": [known_tokens(s) - b for s, b in zip(seqs, before)]})
    return steps


def latencies(steps: list[dict]) -> dict:
    """TTFT of the long prompt, and the decodes' inter-token gaps (median, p99 by nearest rank, largest), from a
    timeline, in seconds. A decode's first gap runs from the prompt's arrival (its previous token came before)."""
    decodes = len(steps[0]["tokens"]) - 1
    gaps = []
    for d in range(decodes):
        arrivals = [0.0] + [s["end"] for s in steps if s["tokens"][d]]
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
    ttft = next(s["end"] for s in steps if s["tokens"][-1])
    p99 = sorted(gaps)[math.ceil(0.99 * len(gaps)) - 1]
    return {"ttft_s": ttft, "itl_median_s": statistics.median(gaps), "itl_p99_s": p99, "itl_max_s": max(gaps)}


def decode_gaps(steps: list[dict]) -> list[float]:
    """The gaps between the steps that gave the decodes a token, in seconds, the first from the prompt's arrival:
    what the running decodes waited, one gap per token (they all get their tokens from the same steps)."""
    decodes = len(steps[0]["tokens"]) - 1
    arrivals = [0.0] + [s["end"] for s in steps if any(s["tokens"][:decodes])]
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def itl_target(results: Results) -> dict | None:
    """The course's chunked-prefill latency target (issue 26), from a run: the decodes' p99 gap chunked over
    prefill-first's, and whether it is at most ITL_P99_TARGET; None without both records (or a run from before p99
    was recorded)."""
    got = {r["impl"]: r for r in results.select(op=Op.STEP_TIMELINE)}
    if set(got) != set(MODES) or any("itl_p99_s" not in r for r in got.values()):
        return None
    ratio = got[Impl.CHUNKED_PREFILL]["itl_p99_s"] / got[Impl.PREFILL_FIRST]["itl_p99_s"]
    return {"itl_p99_chunked_over_prefill_first": round(ratio, 3), "target": ITL_P99_TARGET,
            "met": ratio <= ITL_P99_TARGET}


def measure(run, path, sizes: dict, features, vocab: int) -> None:
    """Both modes on fresh engines (a warm-up timeline first: Triton compiles at first call), recorded as
    Op.STEP_TIMELINE records with the steps and their latencies."""
    import torch

    from lessonlib.engine import LLM

    generator = torch.Generator().manual_seed(0)
    decode_prompts = torch.randint(0, vocab, (sizes["decodes"], sizes["decode_prompt"]), generator=generator).tolist()
    prompt = torch.randint(0, vocab, (sizes["prompt"],), generator=generator).tolist()
    shape = {k: sizes[k] for k in ("decodes", "prompt", "budget")}
    for impl, chunked in MODES.items():
        if run.check_only:
            print(f"checked {Op.STEP_TIMELINE} {impl}", flush=True)
            continue
        for _ in ("warm-up", "measured"):  # a fresh engine each: the warm-up's decodes are left running
            llm = LLM(path, dtype=run.dtype, max_num_seqs=sizes["decodes"] + 1,
                      max_num_batched_tokens=sizes["budget"], max_model_len=2 * sizes["prompt"],
                      features=replace(features, chunked_prefill=chunked))
            steps = timeline(llm, decode_prompts, prompt, sizes["warm_steps"], sizes["after"])
            preemptions = llm.scheduler.num_preemptions
            del llm
            if runtime.on_gpu():
                torch.cuda.empty_cache()
        run.add(Op.STEP_TIMELINE, impl, shape, **{k: round(v, 6) for k, v in latencies(steps).items()},
                preemptions=preemptions, steps=steps)


def summary(results: Results) -> dict | None:
    """{impl: {"ttft_s", "itl_median_s", "itl_max_s"}} from a run, or None without both records."""
    got = {r["impl"]: r for r in results.select(op=Op.STEP_TIMELINE)}
    if set(got) != set(MODES):
        return None
    return {impl: {k: got[impl][k] for k in ("ttft_s", "itl_median_s", "itl_max_s")} for impl in MODES}


def measure_live(path, sizes: dict = SMOKE) -> Results:
    """Both modes on this GPU now, for the model at ``path`` (lesson 07: the tiny model), every feature on but the
    one compared, as a Results."""
    from lessonlib import bench
    from lessonlib.engine import Features
    from lessonlib.engine.config import ModelConfig
    from lessonlib.results import Benchmark, environment

    run = bench.Run(Benchmark.CHUNKED_PREFILL)
    measure(run, path, sizes, Features(), ModelConfig.from_folder(path).vocab_size)
    return Results(run.benchmark, "lessonlib.cases.chunked_prefill.measure_live()", environment(), {}, run.records,
                   run.notes)
