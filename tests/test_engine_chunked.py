"""Chunked prefill (Features.chunked_prefill): the engine's greedy tokens against transformers' (float32, the tiny
model), with prompts longer than the token budget, running decodes in the same step, a prefix-cache hit, preemption
of a prompt in progress, and budgets below a block down to one token.

Most tests run the plain-PyTorch features with chunking on: the scheduling is what they test, and in the interpreter
each step with lessonlib's kernels costs about a second. One test runs the kernels (paged_prefill_attention serving a
mixed step's chunks and one-token decodes against their cached prefixes).
"""

from dataclasses import replace

import pytest
import torch

from lessonlib import runtime, tiny_model
from lessonlib.engine import LLM, Features, SamplingParams, prompt_chunks
from lessonlib.engine.features import PLAIN_PYTORCH
from tests.test_engine import DTYPE, transformers_greedy_ids

CHUNKED = replace(PLAIN_PYTORCH, chunked_prefill=True, continuous_batching=True)
PARITY = pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token parity: an interpreter check")


@pytest.fixture(scope="module")
def path():
    return tiny_model.build()


def random_prompts(*lengths: int) -> list[list[int]]:
    return [torch.randint(3, 500, (n,)).tolist() for n in lengths]  # fresh each run; the tiny vocabulary is 512


def engine(path, budget: int, features: Features = CHUNKED, **kw) -> LLM:
    kw = {"max_num_seqs": 4, "num_blocks": 16, "max_model_len": 128, **kw}
    return LLM(model=str(path), dtype=DTYPE, max_num_batched_tokens=budget, features=features, **kw)


def generate_ids(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def assert_budget_kept(llm: LLM, budget: int) -> None:
    assert llm.steps and all(step.num_tokens <= budget for step in llm.steps), [s.num_tokens for s in llm.steps]
    assert llm.num_blocks_in_use() == 0, "a finished generate left blocks allocated"


@PARITY
def test_chunks_beside_decodes_through_the_kernels_give_transformers_tokens(path):
    prompts = random_prompts(3, 14)  # the long one takes three steps of an 8-token budget, beside the short one
    llm = engine(path, 8, Features(chunked_prefill=True), max_num_seqs=2)
    assert generate_ids(llm, prompts, 2) == transformers_greedy_ids(path, prompts, 2)
    assert_budget_kept(llm, 8)
    # The second step: the short prompt's decode and the long one's second chunk, both after a cached prefix.
    assert (llm.steps[1].kind, llm.steps[1].num_seqs, llm.steps[1].num_tokens) == ("prefill", 1, 8), llm.steps


@PARITY
@pytest.mark.parametrize("budget", [1, 3, 8])
def test_budgets_below_a_block_give_transformers_tokens(path, budget):
    prompts = random_prompts(19, 2, 7)[: 1 if budget == 1 else 3]
    llm = engine(path, budget, max_num_seqs=len(prompts))
    assert generate_ids(llm, prompts, 3) == transformers_greedy_ids(path, prompts, 3)
    assert_budget_kept(llm, budget)
    assert max(s.num_tokens for s in llm.steps) == budget  # the long prompt filled whole steps


@PARITY
def test_a_prefix_cache_hit_skips_the_blocks_earlier_chunks_wrote(path):
    shared = random_prompts(32)[0]  # two full blocks
    prompts = [shared + tail for tail in random_prompts(5, 9)]
    llm = engine(path, 12)  # the second prompt is admitted beside the first one's last chunk
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy_ids(path, prompts, 3)
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == 32
    assert sum(s.num_tokens for s in llm.steps) == 2 * 3 + len(prompts[0]) + len(prompts[1]) - 32 - 2
    assert_budget_kept(llm, 12)


@PARITY
def test_a_prompt_in_progress_preempted_for_a_decode_is_recomputed(path):
    # 5 blocks: the first prompt holds 2 and decodes into a 3rd while the second (3 blocks) is mid-prefill.
    prompts = random_prompts(30, 40)
    llm = engine(path, 8, num_blocks=5, max_num_seqs=2, max_model_len=80)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy_ids(path, prompts, 6)
    assert outs[0].num_preemptions == 0 and outs[1].num_preemptions == 1
    assert_budget_kept(llm, 8)


def test_the_timeline_shows_prefill_first_stalling_the_decodes_and_chunking_not(path):
    """The point of chunking, measured by lessonlib.cases.chunked_prefill (the benchmark's and the lesson's code):
    prefill-first stalls the running decodes for the whole prompt's step; chunked, they get a token every step."""
    from lessonlib import bench, plots
    from lessonlib.cases import chunked_prefill
    from lessonlib.results import Benchmark, Impl, Results, environment

    sizes = dict(decodes=2, decode_prompt=3, prompt=40, budget=16, warm_steps=1, after=2)
    run = bench.Run(Benchmark.CHUNKED_PREFILL, dtype=DTYPE)
    chunked_prefill.measure(run, path, sizes, CHUNKED, vocab=500)
    recorded = Results(run.benchmark, "test", environment(), {}, run.records, {})
    timelines = {r["impl"]: r["steps"] for r in run.records}
    decode_tokens = {impl: [sum(step["tokens"][:-1]) for step in steps] for impl, steps in timelines.items()}
    assert decode_tokens[Impl.PREFILL_FIRST][0] == 0 and all(decode_tokens[Impl.PREFILL_FIRST][1:])
    assert all(n == sizes["decodes"] for n in decode_tokens[Impl.CHUNKED_PREFILL])
    chunks = -(-sizes["prompt"] // (sizes["budget"] - sizes["decodes"]))  # steps until its first token
    assert [step["tokens"][-1] for step in timelines[Impl.CHUNKED_PREFILL]] == [0] * (chunks - 1) + [1] * sizes["after"]
    latency = chunked_prefill.summary(recorded)
    assert all(row["ttft_s"] > 0 and row["itl_max_s"] >= row["itl_median_s"] > 0 for row in latency.values())
    p99 = {r["impl"]: r["itl_p99_s"] for r in run.records}
    assert all(r["itl_max_s"] >= r["itl_p99_s"] >= r["itl_median_s"] for r in run.records)
    target = chunked_prefill.itl_target(recorded)
    assert target["met"] == (p99[Impl.CHUNKED_PREFILL] <= 0.5 * p99[Impl.PREFILL_FIRST])
    assert plots.chunked_prefill_timeline(recorded).axes


def test_the_budget_split_exercise_passes_its_solution_and_names_planted_mistakes(capsys):
    from lessonlib.exercises import ExerciseFailed, check_prompt_chunks
    from lessonlib.grading.exercise_format import strip_solutions
    from tests.test_kernel_exercises import define, mutated, solution_source

    source = solution_source("07_serving_engine.ipynb", "my_prompt_chunks")
    check_prompt_chunks(define(source, "my_prompt_chunks"))
    assert capsys.readouterr().out.startswith("✓ prompt_chunks")
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        check_prompt_chunks(define(strip_solutions(source), "my_prompt_chunks"))
    for (old, new), named in [(("max_num_batched_tokens - num_decodes", "max_num_batched_tokens"), "decodes take one"),
                              (("min(left, budget)", "budget"), "never takes more than its tokens left"),
                              (("        budget -= chunks[-1]\n", ""), "share one budget"),
                              (("    for left in prompt_tokens_left:\n",  # stops once the budget is spent
                                "    for left in prompt_tokens_left:\n        if budget <= 0:\n            break\n"),
                               "one chunk per prompt, in order, 0 for each prompt the budget does not reach"),
                              (("    return chunks", "    return torch.tensor(chunks)"), "return a list of ints")]:
        with pytest.raises(ExerciseFailed, match=named):
            check_prompt_chunks(define(mutated(source, old, new), "my_prompt_chunks"))


@pytest.mark.skipif(runtime.on_gpu(), reason=(
    "seeded draws are equal only where the logits are: in float32 (the interpreter) a chunked and an unchunked "
    "prefill differ by float32 rounding (~1e-6 of a probability), which moves a draw about once in a million; on a "
    "GPU the engine runs 16 bits, whose rounding moves draws near a boundary of the distribution (the H200 met one)"))
def test_sampled_requests_draw_the_same_tokens_with_and_without_chunking(path):
    """The scheduling does not touch the sampling: each request's seeded generator draws once per token, in order,
    whether its prompt came in chunks or at once."""
    prompts = random_prompts(21, 4)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=7, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in engine(path, 5, features).generate(
        [{"prompt_token_ids": p} for p in prompts], params)] for features in (CHUNKED, replace(CHUNKED, chunked_prefill=False))]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("budget, message", [(0, "must be an int >= 1"), (2.5, "must be an int >= 1"),
                                             (True, "must be an int >= 1"), (3, "at least max_num_seqs")])
def test_bad_budgets_are_refused_before_anything_is_built(path, budget, message):
    with pytest.raises(ValueError, match=message):
        engine(path, budget)


def test_prompt_chunks_split_the_budget_left_by_the_decodes_in_order():
    assert prompt_chunks(3, [10, 4], 8) == [5, 0]
    assert prompt_chunks(0, [2, 9, 1], 8) == [2, 6, 0]
    assert prompt_chunks(4, [7], 4) == [0]


@pytest.mark.skipif(not runtime.on_gpu(), reason="CUDA graphs and 16-bit kernels: a GPU check")
def test_chunked_prefill_on_the_gpu_gives_the_prefill_first_tokens(path):
    """Every feature on (CUDA graphs for the decode-only steps, scheduling ahead), chunked against prefill-first,
    prompts longer than the budget among decodes. In 16 bits the two sum attention in their own order, so they may
    part at a near-tie (show_live_ladder's rule, measured in float64); anything wider, or a block left, raises."""
    from lessonlib.cases.serving_engine import run_ladder, show_live_ladder
    from tests.test_engine import PREFIX

    prompts = ["Hello, my name is", PREFIX + PREFIX, PREFIX + " a paged KV cache"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 6, 5)]
    rungs = [("prefill-first", Features()), ("chunked prefill", Features(chunked_prefill=True))]
    runs = run_ladder(str(path), prompts, params, rungs=rungs, dtype=DTYPE, max_num_seqs=4, max_model_len=256,
                      max_num_batched_tokens=16)
    assert runs[1].prefill_steps > runs[0].prefill_steps  # the long prompt took several mixed steps
    show_live_ladder(runs, runs[0].tokens, model_path=path, prompts=prompts, dtype=DTYPE)
