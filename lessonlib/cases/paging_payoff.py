"""Paging's payoff, the vLLM paper's result, measured: for the same KV-cache memory, the largest batch that fits
when each sequence reserves a contiguous slab of ``max_model_len`` tokens, against paged blocks that hold what each
sequence uses, and the decode tokens/s the engine reaches at each of the two batches.

The workload: requests whose lengths (prompt and new tokens) follow lesson 03's spread (``kv_memory.request_lengths``:
log-normal, most short, a few near the limit), each generating ``new_tokens`` tokens after its prompt. The pool
holds ``slabs`` slabs' worth of tokens. Slabs fit ``slabs`` sequences, whatever they use; blocks fit as many of the
requests, in order, as their blocks at the end of the run add up to the pool (``kv_memory.largest_batch``). Each
batch then runs on the engine (``lessonlib.engine.LLM``: the same kernels either way, the same pool, ``max_num_seqs``
set to the batch) ``repeats`` times: every request admitted at once, no preemption (checked), decode tokens/s from
the engine's step log (decode steps' tokens over their seconds), the median run's with the slowest and fastest.

    python -m benchmarks.bench_paging_payoff --out lessonlib/results/paging-payoff-h200.json
"""

from __future__ import annotations

import statistics

import torch

from lessonlib import kv_memory, runtime
from lessonlib.results import Impl, Op, Results

# Full size (a Llama-3.2-1B-shaped model, 32 KiB of K and V per token in bf16): a pool of 16 slabs of 2,048 tokens,
# 1 GiB; lengths around 300 tokens. Smoke (the interpreter, a tiny model): 4 slabs of 64 tokens.
FULL = dict(slabs=16, max_model_len=2048, median=300, new_tokens=32, requests=512, block_size=16)
SMOKE = dict(slabs=4, max_model_len=64, median=12, new_tokens=2, requests=64, block_size=16)


def workload(slabs: int, max_model_len: int, median: int, new_tokens: int, requests: int, block_size: int,
             seed: int = 0) -> dict:
    """Each request's total length (prompt + new tokens, at least new_tokens + 1, at most max_model_len), the pool
    in blocks, and the largest batch each way."""
    lengths = kv_memory.request_lengths(requests, median, max_model_len, seed).clamp(min=new_tokens + 1)
    num_blocks = slabs * max_model_len // block_size
    fit = kv_memory.largest_batch(lengths, num_blocks * block_size, max_model_len, block_size)
    return {"lengths": lengths.tolist(), "num_blocks": num_blocks, "batch": {Impl.KV_SLABS: fit.slabs,
                                                                               Impl.KV_BLOCKS: fit.blocks}}


def decode_tokens_per_s(steps) -> float:
    """Decode steps' tokens over their seconds, from an engine's step log."""
    decode = [s for s in steps if s.kind == "decode"]
    return sum(s.num_tokens for s in decode) / sum(s.seconds for s in decode)


def run_batch(path, lengths: list[int], batch: int, num_blocks: int, new_tokens: int, repeats: int, vocab: int,
              **engine) -> dict:
    """The first ``batch`` requests on a fresh engine with ``max_num_seqs=batch``: a warm-up, then ``repeats`` timed
    runs. Random prompt tokens (seeded), so no two requests share a prefix block."""
    from lessonlib.engine import LLM, SamplingParams

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n - new_tokens,), generator=generator).tolist() for n in lengths[:batch]]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm = LLM(path, num_blocks=num_blocks, max_num_seqs=batch, **engine)
    llm.generate(prompts, params)  # warm-up: Triton compiles at first call
    rates, blocks_peak = [], 0
    for _ in range(repeats):
        llm.block_manager.forget_prefix_cache()  # every run prefills its prompts anew
        llm.generate(prompts, params)
        rates.append(decode_tokens_per_s(llm.steps))
        blocks_peak = max(blocks_peak, max(s.blocks_used for s in llm.steps))
        if max(s.num_seqs for s in llm.steps if s.kind == "decode") != batch:
            raise AssertionError(f"batch {batch}: the engine never ran all {batch} sequences in one decode step")
    preempted = llm.scheduler.num_preemptions  # over the engine's life: the warm-up and every run
    del llm
    if runtime.on_gpu():
        torch.cuda.empty_cache()
    return {"decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_min": min(rates),
            "decode_tokens_per_s_max": max(rates), "repeats": repeats, "preemptions": preempted,
            "blocks_used_peak": blocks_peak}


def measure(run, path, sizes: dict, repeats: int, **engine) -> None:
    """Both batches of the workload, recorded as Op.LARGEST_BATCH records (impl: how memory is reserved)."""
    from lessonlib.engine import ModelConfig

    config = ModelConfig.from_folder(path)
    work = workload(**sizes)
    element = torch.empty((), dtype=run.dtype).element_size()
    block_bytes = 2 * config.num_layers * sizes["block_size"] * config.num_kv_heads * config.head_dim * element
    shape = {"pool_blocks": work["num_blocks"], "block_size": sizes["block_size"],
             "max_model_len": sizes["max_model_len"], "new_tokens": sizes["new_tokens"]}
    run.notes["workload"] = {**sizes, "pool_bytes": work["num_blocks"] * block_bytes,
                             "lengths": work["lengths"][:max(work["batch"].values())]}
    for impl, batch in work["batch"].items():
        if run.check_only:
            print(f"checked {Op.LARGEST_BATCH} {impl}: batch {batch}", flush=True)
            continue
        measured = run_batch(path, work["lengths"], batch, work["num_blocks"], sizes["new_tokens"], repeats,
                             config.vocab_size, dtype=run.dtype, block_size=sizes["block_size"],
                             max_model_len=sizes["max_model_len"], **engine)
        used = sum(-(-n // sizes["block_size"]) for n in work["lengths"][:batch])
        run.add(Op.LARGEST_BATCH, impl, shape, batch=batch, kv_blocks_needed=used,
                **{k: round(v, 1) if isinstance(v, float) else v for k, v in measured.items()})


def payoff(results: Results) -> dict | None:
    """{"batch": blocks / slabs, "decode_tokens_per_s": blocks / slabs, "spreads_apart": whether the two batches'
    slowest-to-fastest ranges of decode tokens/s do not overlap} from a run, or None without its records."""
    got = {r["impl"]: r for r in results.select(op=Op.LARGEST_BATCH)}
    if Impl.KV_SLABS not in got or Impl.KV_BLOCKS not in got:
        return None
    slabs, blocks = got[Impl.KV_SLABS], got[Impl.KV_BLOCKS]
    return {"batch": blocks["batch"] / slabs["batch"],
            "decode_tokens_per_s": blocks["decode_tokens_per_s"] / slabs["decode_tokens_per_s"],
            "spreads_apart": blocks["decode_tokens_per_s_min"] > slabs["decode_tokens_per_s_max"]
            or blocks["decode_tokens_per_s_max"] < slabs["decode_tokens_per_s_min"]}


LIVE = dict(slabs=8, max_model_len=512, median=80, new_tokens=16, requests=256, block_size=16)  # the tiny model


def measure_live(path, sizes: dict = LIVE, repeats: int = 3) -> Results:
    """The measurement on this GPU now, for the model at ``path`` (lesson 03: the tiny model), as a Results."""
    from lessonlib import bench
    from lessonlib.results import Benchmark, environment

    run = bench.Run(Benchmark.PAGING_PAYOFF)
    measure(run, path, sizes, repeats)
    return Results(run.benchmark, "lessonlib.cases.paging_payoff.measure_live()", environment(), {}, run.records,
                   run.notes)
