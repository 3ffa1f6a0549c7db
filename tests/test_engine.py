"""Lesson 07's engine against Hugging Face transformers' ``generate`` (never mocked), in float32 on the tiny models.

Float32 keeps rounding far below the tiny models' gaps between the best and second-best token (their weights have a
wide spread for that: see lessonlib.tiny_model), so greedy tokens must match exactly. Kept small: in the
interpreter every decode step of the tiny model costs about a second.
"""

import json
import random

import pytest
import torch

from lessonlib import runtime, serving, tiny_model
from lessonlib.engine import LLM, Features, SamplingParams, can_admit, top_p_filter
from tests.engine_fixtures import llm, path  # noqa: F401 (fixtures)

PREFIX = ("Attention reads every key and value of a sequence for every query. The score matrix grows with the "
          "square of the sequence length, so")
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
DTYPE = runtime.dtype(cpu=torch.float32)  # float32 in the interpreter; the GPU runs 16-bit (see test docstring)
# A dtype the engine must refuse here: bfloat16 in the interpreter (and below sm_80), float32 on a GPU (flash_attention
# would run it as TF32).
UNSUPPORTED = torch.bfloat16 if torch.bfloat16 not in runtime.supported_dtypes() else torch.float32


def transformers_greedy(path, prompts, max_tokens):
    return serving.hf_greedy(str(path), prompts, max_tokens=max_tokens, dtype=DTYPE)


def transformers_greedy_ids(path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations of prompts given as token ids (no stop token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE).eval()
    with torch.inference_mode():
        # attention_mask given: else generate masks every id 0 (the pad id) in the prompt (benchmarks/experiments/generate_oracle.py)
        return [model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist() for prompt in prompts]


def assert_same_tokens(outs, expected, prompts):
    for out, want, prompt in zip(outs, expected, prompts):
        got = out.outputs[0].token_ids
        assert serving.first_difference(got, want) is None, f"{prompt!r}: engine {got}, transformers {want}"


@pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token parity is an interpreter check; the GPU "
                    "benchmark checks bf16 logits with a stated tolerance")
def test_greedy_tokens_match_transformers_batched_with_a_shared_prefix(path, llm):
    prompts = [PREFIX + " FlashAttention computes it tile by tile.", "Hello, my name is",
               PREFIX + " a paged KV cache", "The capital of France is Paris. The quick brown fox jumps over"]
    outs = llm.generate(prompts, GREEDY)
    assert_same_tokens(outs, transformers_greedy(path, prompts, GREEDY.max_tokens), prompts)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens and o.outputs[0].finish_reason == "length" for o in outs)
    # The third prompt was admitted in the same step as the first and shares its full prefix blocks: its prefill
    # read them through the block table (paged_prefill_attention), written moments before by the first.
    prefix_blocks = len(llm.tokenizer.encode(PREFIX)) // llm.block_size
    assert prefix_blocks >= 1 and outs[2].num_cached_tokens == prefix_blocks * llm.block_size
    assert outs[0].num_cached_tokens == 0 and llm.steps[0].cached_tokens == outs[2].num_cached_tokens
    assert llm.num_blocks_in_use() == 0, "a finished generate left blocks allocated"

    # A later call reuses the prefix blocks the first call left in the cache (freed, still findable).
    later = [PREFIX + " the online softmax"]
    again = llm.generate(later, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert again[0].num_cached_tokens == prefix_blocks * llm.block_size
    assert_same_tokens(again, transformers_greedy(path, later, 3), later)
    assert llm.num_blocks_in_use() == 0


@pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token parity: an interpreter check")
def test_a_lone_prompt_prefilled_padded_to_its_bucket_gives_transformers_tokens_and_writes_no_other_block(path):
    """The CUDA-graph prefill's step (PrefillGraphs), run eagerly: a prompt padded to its bucket of rows. The pool
    starts poisoned with NaN: a padding row's K/V in any block but the padding block would show there, and a prompt
    token that saw a padding row would change the tokens."""
    from lessonlib.engine.model_runner import PrefillGraphs

    llm = LLM(model=str(path), dtype=DTYPE, max_num_seqs=2, num_blocks=16, max_model_len=256)
    runner = llm.runner
    runner.prefill_graphs = PrefillGraphs(runner, 256, capture=False)
    assert runner.prefill_graphs.buckets == [16, 32, 64, 128, 256]
    padded = []
    real_step = runner.prefill_graphs._step
    runner.prefill_graphs._step = lambda bucket: padded.append(bucket) or real_step(bucket)
    runner.k_caches.fill_(float("nan"))
    runner.v_caches.fill_(float("nan"))
    prompt = PREFIX + " the online softmax"
    n = len(llm.tokenizer.encode(prompt))
    assert n % 16 and runner.prefill_graphs.bucket(n) > n  # padding rows present
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt], params)
    assert padded == [runner.prefill_graphs.bucket(n)]
    assert_same_tokens(outs, transformers_greedy(path, [prompt], 4), [prompt])
    written = ~torch.isnan(runner.k_caches).all(dim=(0, 2, 3, 4))  # per block: did any row write it?
    written_v = ~torch.isnan(runner.v_caches).all(dim=(0, 2, 3, 4))
    held = llm.block_manager.blocks_for(n + 4 - 1)  # the K/V of the prompt and of the 3 tokens fed back
    assert torch.equal(written, written_v) and int(written[:-1].sum()) == held and bool(written[-1])
    assert llm.num_blocks_in_use() == 0


@pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token parity: an interpreter check")
def test_preemption_and_waiting_under_a_tiny_block_budget(path):
    # Four 16-token blocks for four prompts of 14-15 tokens: each is admitted with one block, then needs a second
    # one for its 17th token. Not all fit: the latest admitted are preempted, wait, and are recomputed later.
    llm = LLM(model=str(path), dtype=DTYPE, num_blocks=4, max_num_seqs=4)
    rng = random.Random()
    prompts = [[rng.randrange(3, llm.config.vocab_size) for _ in range(rng.randrange(14, 16))] for _ in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert sum(o.num_preemptions for o in outs) >= 1 and llm.scheduler.num_preemptions >= 1
    assert max(step.waiting for step in llm.steps) >= 1
    assert max(step.blocks_used for step in llm.steps) <= 4
    assert llm.num_blocks_in_use() == 0
    # Recomputed requests give the tokens transformers gives.
    for out, want in zip(outs, transformers_greedy_ids(path, prompts, 5)):
        assert out.outputs[0].token_ids == want


def test_bad_input_is_refused_clearly_and_the_engine_stays_usable(path, llm, tmp_path):
    for spoil, error, message in [
        (lambda: llm.generate([]), ValueError, "non-empty list"),
        (lambda: llm.generate(["fine", ""]), ValueError, "empty prompt"),
        (lambda: llm.generate([[5] * 256]), ValueError, "longer than the cache can hold"),
        (lambda: llm.generate([[5, 10**6]]), ValueError, "out of range"),
        (lambda: llm.generate(["fine"], "greedy"), TypeError, "SamplingParams"),
        (lambda: SamplingParams(top_p=0.0), ValueError, "top_p"),
        (lambda: LLM(model=str(path), dtype=UNSUPPORTED), TypeError, str(UNSUPPORTED).removeprefix("torch.")),
        (lambda: LLM(model=str(path), block_size=8), ValueError, "block_size"),
        (lambda: LLM(model=str(tmp_path)), FileNotFoundError, "config.json"),
    ]:
        with pytest.raises(error, match=message):
            spoil()
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(model=str(tmp_path))
    assert llm.num_blocks_in_use() == 0 and not llm.has_unfinished_requests()

    # A step that fails half-way frees everything (and forgets the prefix cache, which it may have half written).
    # It fails at the second decode step, launched while the first still runs (asynchronous scheduling).
    before = llm.generate([[7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    real_decode, decodes = llm.runner.decode, []

    def failing_decode(seqs, previous_rows=None):
        decodes.append(previous_rows)
        if len(decodes) == 2:
            assert llm._in_flight is None and previous_rows == [0]  # taken over by step(); its token on the device
            raise RuntimeError("injected failure")
        return real_decode(seqs, previous_rows)

    llm.runner.decode = failing_decode
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=3))
        decodes.clear()
        seq = llm.add_request([5, 6], SamplingParams(temperature=0.0, max_tokens=4))  # the same, step by step
        with pytest.raises(RuntimeError, match="injected failure"):
            while llm.has_unfinished_requests():
                llm.step()
    finally:
        llm.runner.decode = real_decode
    # Its prefill's token only: the first decode step's token had not reached the host, and never will.
    aborted = llm.output(seq).outputs[0]
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 1 and min(aborted.token_ids) >= 0
    assert llm.num_blocks_in_use() == 0 and not llm.has_unfinished_requests()
    assert not llm.block_manager.allocator.block_with
    after = llm.generate([[7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert after[0].outputs[0].token_ids == before[0].outputs[0].token_ids and llm.num_blocks_in_use() == 0


@pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token parity: an interpreter check")
def test_async_scheduling_gives_the_synchronous_tokens_and_cache(path):
    """Steps scheduled ahead of their predecessors' tokens (the default) against the host waiting for every token:
    the same tokens and finish reasons, a stop token one request meets mid-run (the step scheduled behind it is
    wasted, its token dropped), a queue (two seats for four requests), blocks filled during decode registered in
    the prefix cache and found by a later prompt, nothing left allocated."""
    from dataclasses import replace


    engines = {name: LLM(model=str(path), dtype=DTYPE, max_num_seqs=2, num_blocks=32, max_model_len=256,
                         features=Features(async_scheduling=name == "ahead")) for name in ("sync", "ahead")}
    rng = random.Random()
    vocab = engines["sync"].config.vocab_size
    lengths = [6, 3, 5, 4]
    stop_at = None
    while stop_at is None:  # the first request's stop token: one of its tokens 2..5 that it has not emitted before
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (14, 9, 20, 5)]  # 14 + 6 tokens: a full block
        free = engines["sync"].generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                                  for n in lengths])
        first = free[0].outputs[0].token_ids
        stop_at = next((i for i in range(2, 6) if first[i] not in first[:i]), None)
    params = [SamplingParams(temperature=0.0, max_tokens=lengths[0])] + [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths[1:]]
    ahead_steps = []
    for name, llm in engines.items():
        llm.config = replace(llm.config, eos_token_ids=(first[stop_at],))
        schedule_ahead = llm.scheduler.schedule_ahead
        llm.scheduler.schedule_ahead = lambda ends, name=name, f=schedule_ahead: (
            ahead_steps.append(name) if name == "ahead" else None) or f(ends)
    outs = {name: llm.generate(prompts, params) for name, llm in engines.items()}
    assert len(ahead_steps) >= 5 and "sync" not in ahead_steps
    # Alone, the first request's stop token is met by a step that already has a successor in flight: that step's
    # row is wasted (skipped when it completes, its token dropped), and nothing else differs.
    alone = {name: llm.generate(prompts[:1], params[0])[0].outputs[0] for name, llm in engines.items()}
    assert alone["ahead"].token_ids == alone["sync"].token_ids == first[:stop_at + 1]
    rows = {name: sum(s.num_seqs for s in llm.steps if s.kind == "decode") for name, llm in engines.items()}
    assert rows == {"sync": stop_at, "ahead": stop_at + 1}
    assert outs["sync"][0].outputs[0].token_ids == first[:stop_at + 1]
    assert outs["sync"][0].outputs[0].finish_reason == "stop"
    for a, b in zip(outs["sync"], outs["ahead"]):
        assert (a.outputs[0].token_ids, a.outputs[0].finish_reason) == \
               (b.outputs[0].token_ids, b.outputs[0].finish_reason)
    for out, want in zip(outs["sync"][1:], free[1:]):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    for llm in engines.values():
        assert llm.num_blocks_in_use() == 0 and not llm.has_unfinished_requests()
    # The first request's first block (14 prompt tokens, then 2 generated) was filled by decode steps: registered
    # in the prefix cache once their tokens reached the host, and found by a later prompt that starts the same way.
    later = [prompts[0] + first[:2] + [3]]
    want = transformers_greedy_ids(path, later, 2)[0]
    for name, llm in engines.items():
        again = llm.generate(later, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert again[0].num_cached_tokens == 16, name
        assert again[0].outputs[0].token_ids == want, name


@pytest.mark.parametrize("scenario", ["queue", "stop token", "preemption", "static batching", "sampled",
                                      "cache limit"])
def test_scheduling_ahead_keeps_the_synchronous_schedule(path, scenario):
    """The engine with and without asynchronous scheduling, on workloads where the next step's decision could depend
    on tokens the host has not seen: the same tokens and finish reasons, and (but for a stop token's one extra row)
    the same steps with the same batches, so admission is not delayed. On the GPU with CUDA graphs, where the
    overlap is real: the tokens must be identical too, since both engines run the same batches through the same
    kernels (but for the stop token, whose extra row changes a batch). In the interpreter with plain-PyTorch
    features (the scheduling is what is tested; each step is fast)."""
    from dataclasses import replace

    from lessonlib.engine.features import PLAIN_PYTORCH

    if scenario == "stop token" and runtime.on_gpu():
        pytest.skip("a stop token's extra row changes one step's batch size; in 16 bits another size may run another "
                    "GEMM kernel and flip a near-tie: the interpreter checks this scenario in float32")
    base = Features() if runtime.on_gpu() else replace(PLAIN_PYTORCH, continuous_batching=True)
    engine = {"max_num_seqs": 4, "num_blocks": 32, "max_model_len": 256}
    rng = random.Random()
    count = 6
    lengths = [rng.randrange(2, 12) for _ in range(count)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    if scenario == "preemption":
        # six prompts of 14-15 tokens that all grow past their first 16-token block: four running need eight
        # blocks of the five. (With 2 to 11 new tokens, requests that stayed within one block could leave nobody
        # preempted: the full suite's run drew that once.)
        engine["num_blocks"] = 5
        params = [replace(p, max_tokens=rng.randrange(4, 12)) for p in params]
    elif scenario == "static batching":
        base = replace(base, continuous_batching=False)
    elif scenario == "sampled":
        params = [replace(p, temperature=0.8, seed=i) if i % 2 else p for i, p in enumerate(params)]
    elif scenario == "cache limit":
        engine["max_model_len"] = 20  # every request stops at the cache's end, at 5-6 new tokens
        params = [replace(p, max_tokens=16) for p in params]
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(14, 16))] for _ in range(count)]
    engines = {on: LLM(model=str(path), dtype=DTYPE, features=replace(base, async_scheduling=on), **engine)
               for on in (False, True)}
    if scenario == "stop token":  # a token the first request meets mid-run ends it (and any other that meets it)
        first = engines[False].generate(prompts[:1], params[0])[0].outputs[0].token_ids
        for llm in engines.values():
            llm.config = replace(llm.config, eos_token_ids=(first[len(first) // 2],))
        params = [replace(p, ignore_eos=False) for p in params]
    outs = {on: llm.generate(prompts, params) for on, llm in engines.items()}
    for a, b in zip(outs[False], outs[True]):
        assert (a.outputs[0].token_ids, a.outputs[0].finish_reason, a.num_preemptions) == \
               (b.outputs[0].token_ids, b.outputs[0].finish_reason, b.num_preemptions), scenario
    schedule = {on: [(s.kind, s.num_seqs, s.cached_tokens) for s in llm.steps] for on, llm in engines.items()}
    if scenario == "stop token":
        stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs[False])
        rows = {on: sum(n for kind, n, _ in steps if kind == "decode") for on, steps in schedule.items()}
        assert stopped >= 1 and rows[True] - rows[False] <= stopped
    else:
        assert schedule[True] == schedule[False], scenario
    if scenario == "preemption":
        assert sum(o.num_preemptions for o in outs[False]) >= 1
    if scenario == "cache limit":
        assert {o.outputs[0].finish_reason for o in outs[False]} == {"length"}
        assert all(len(p) + len(o.outputs[0].token_ids) == 20 for p, o in zip(prompts, outs[False]))
    for llm in engines.values():
        assert llm.num_blocks_in_use() == 0 and not llm.has_unfinished_requests()


def test_seeded_sampling_is_reproducible_and_top_p_keeps_the_nucleus(llm):
    prompt = "The quick brown fox"
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, seed=1234, ignore_eos=True)
    nucleus_of_one = SamplingParams(temperature=1.0, top_p=1e-9, max_tokens=4, seed=99, ignore_eos=True)
    outs = llm.generate([prompt, prompt, prompt, prompt],
                        [seeded, seeded, nucleus_of_one, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    # Each request draws from its own generator: the same seed gives the same tokens, in any batch.
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    alone = llm.generate([prompt], seeded)
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    # A nucleus of mass ~0 holds only the most likely token: sampling from it is greedy decoding.
    assert outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids
    assert llm.num_blocks_in_use() == 0


def test_top_p_filter_keeps_the_smallest_set_reaching_top_p():
    for _ in range(20):
        vocab = random.randrange(1, 50)
        probs = torch.softmax(3 * torch.randn(3, vocab, dtype=torch.float64), dim=-1)
        top_p = torch.rand(3, dtype=torch.float64).clamp_min(1e-6)
        kept = top_p_filter(probs, top_p)
        for row in range(3):
            order = probs[row].argsort(descending=True)
            mass = probs[row][order].cumsum(0)
            size = int((mass < top_p[row]).sum()) + 1  # tokens until the mass first reaches top_p
            size = min(size, vocab)
            expected = torch.zeros(vocab, dtype=torch.float64)
            expected[order[:size]] = probs[row][order[:size]] / probs[row][order[:size]].sum()
            torch.testing.assert_close(kept[row], expected)


def test_admission_rule():
    base = dict(prompt_blocks=4, cached_idle_blocks=0, cached_busy_blocks=0, free_blocks=4, running=0,
                max_num_seqs=2, new_tokens=64, batched_tokens=0, max_batched_tokens=100)
    assert can_admit(**base)
    assert not can_admit(**{**base, "free_blocks": 3})
    assert can_admit(**{**base, "free_blocks": 2, "cached_busy_blocks": 2})  # shared blocks cost nothing
    assert not can_admit(**{**base, "free_blocks": 2, "cached_idle_blocks": 2})  # idle cached ones leave the free list
    assert not can_admit(**{**base, "running": 2})
    assert not can_admit(**{**base, "batched_tokens": 50})
    assert can_admit(**{**base, "new_tokens": 500})  # a lone prompt always fits the token budget


@pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token parity: an interpreter check")
def test_a_llama_checkpoint_matches_transformers(tmp_path_factory):
    path = tiny_model.build(architecture="llama")
    llm = LLM(model=str(path), dtype=DTYPE, max_num_seqs=4, num_blocks=16, max_model_len=128)
    prompts = ["Hello, my name is", "A paged KV cache stores keys and values in fixed-size blocks."]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert_same_tokens(outs, transformers_greedy(path, prompts, 3), prompts)


def test_bench_engine_smoke_writes_a_results_file(tmp_path):
    from tests.test_benchmarks import run_smoke

    recorded = run_smoke("bench_engine.py", tmp_path)
    assert recorded.benchmark == "engine" and "--smoke" in recorded.command
    assert recorded.select(op="generate", impl="transformers generate (dynamic cache, eager)")
    assert recorded.select(op="generate", impl="lessonlib engine, eager")
    if runtime.on_gpu():  # the peer that shows what asynchronous scheduling gives
        assert recorded.select(op="generate", impl="lessonlib engine, CUDA graphs, synchronous scheduling")
    check = recorded.notes["checks"]["lessonlib engine, eager"]
    assert check["passed"] and check["greedy_tokens"]["all_divergences_near_ties"]
    ladder = recorded.select(op="tokens_per_s_ladder")
    graphs = ["+ CUDA graphs"] if runtime.on_gpu() else []  # a rung only where graphs can be captured
    assert [r["impl"] for r in ladder] == ["plain PyTorch", "+ fused ops", "+ FlashAttention prefill", "+ paged decode",
                                           *graphs, "+ continuous batching"]
    assert all(r["tokens_per_s"] > 0 for r in ladder)
    if not runtime.on_gpu():  # float32 in the interpreter: every rung gives the same tokens. In bf16 on a GPU the
        # rungs' different summation orders flip near-ties (the benchmark's checks report them), so no equality there.
        assert all(r["same_tokens_as_top_rung"] == r["shape"]["requests"] for r in ladder)
    from lessonlib.plots.serving_engine import plot_ladder

    assert len(plot_ladder(recorded).patches) == len(ladder)
    steps = {r["fused_decode_layer"]: r for r in recorded.select(op="batch-1 decode step")}  # Features' switch
    assert steps[True]["kernels_per_layer"] == 6 and steps[False]["kernels_per_layer"] == 9
    from lessonlib.plots.serving_engine import fused_decode_summary

    assert "off / on: 9 / 6 kernels per layer" in fused_decode_summary(recorded)


def test_the_batch_1_summary_reads_the_recorded_run():
    """Lesson 07's two printed lines about batch 1 come from the committed H200 run's records."""
    from lessonlib import results
    from lessonlib.plots.serving_engine import batch_1_summary

    recorded = results.find("engine-h200")
    engine = recorded.select(op="generate", impl="lessonlib engine, CUDA graphs", batch=1)[0]
    sync = recorded.select(op="engine_steps", impl="lessonlib engine, CUDA graphs, synchronous scheduling", batch=1)[0]
    text = batch_1_summary(recorded)
    assert f"{engine['tokens_per_s']:,.0f} tokens/s" in text
    assert f"{sync['decode_step_us']:,.0f} µs with the host" in text
    del recorded.notes["weight_read_limit_tokens_per_s_batch_1"]
    assert "predates" in batch_1_summary(recorded)


@pytest.mark.skipif(not runtime.on_gpu(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_eager_tokens(path):
    graphs = LLM(model=str(path), dtype=DTYPE, max_num_seqs=8, max_model_len=256)
    eager = LLM(model=str(path), dtype=DTYPE, max_num_seqs=8, max_model_len=256,
                features=Features(cuda_graphs=False))
    assert graphs.cuda_graphs and not eager.cuda_graphs
    prompts = ["Hello, my name is", PREFIX, "The capital of France is Paris."]  # 3 rows: the graph of 4 pads one
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for a, b in zip(graphs.generate(prompts, params), eager.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    prefill_graphs, replayed = graphs.runner.prefill_graphs, []
    real_run = prefill_graphs.run
    prefill_graphs.run = lambda seq, bucket: replayed.append(bucket) or real_run(seq, bucket)
    for prompt in prompts:  # alone, each prompt's prefill is replayed from its bucket's graph, padded
        for llm in (graphs, eager):
            llm.block_manager.forget_prefix_cache()  # else PREFIX's blocks, cached above, skip the graph
        a, b = graphs.generate([prompt], params), eager.generate([prompt], params)
        assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids, prompt
    assert replayed == [prefill_graphs.bucket(len(graphs.tokenizer.encode(p))) for p in prompts]
    assert graphs.num_blocks_in_use() == 0


def test_exercise_checkers_pass_the_engine_and_catch_wrong_rules(capsys):
    from lessonlib.exercises import ExerciseFailed, check_can_admit, check_top_p_filter

    check_can_admit(can_admit)
    check_top_p_filter(top_p_filter)
    assert "✓" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="shared"):  # forgets that blocks in use by others cost nothing
        check_can_admit(lambda **a: a["prompt_blocks"] <= a["free_blocks"] and a["running"] < a["max_num_seqs"])
    with pytest.raises(ExerciseFailed, match="top_p_filter"):  # keeps one token too many at the boundary
        check_top_p_filter(lambda p, t: top_p_filter(p, torch.clamp(t + 1e-3, max=1.0)))


def test_simulated_arrivals_never_overfill_the_pool():
    from lessonlib.cases.serving_engine import simulate

    records = simulate(arrival_rate=0.4, block_size=16, num_blocks=64, steps=300, seed=random.randrange(1000))
    assert max(r.blocks_used for r in records) <= 64
    assert records[-1].preemptions > 0 and max(r.blocks_reserved for r in records) > 64  # the point of paging
    assert records[-1].cached_tokens > 0


@pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token parity: an interpreter check")
def test_every_rung_of_the_ladder_gives_transformers_tokens(path):
    from lessonlib.cases.serving_engine import run_ladder

    # Two seats for three requests of different lengths and output lengths: static batching must wait for the first
    # batch's longest request, continuous batching admits the third as soon as a seat frees. The third shares the
    # first's prefix: its prefill reads cached blocks (paged_prefill_attention, or gather + attention when off).
    prompts = [PREFIX + " FlashAttention computes it tile by tile.", "Hello, my name is", PREFIX + " a paged KV cache"]
    lengths = [2, 4, 3]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    runs = run_ladder(str(path), prompts, params, dtype=DTYPE, max_num_seqs=2, num_blocks=32, max_model_len=256)
    theirs = transformers_greedy(path, prompts, max(lengths))
    assert [r.label for r in runs] == ["plain PyTorch", "+ fused ops", "+ FlashAttention prefill", "+ paged decode",
                                       "+ continuous batching"]  # "+ CUDA graphs" is eager without a GPU
    for run in runs:
        for got, want, n in zip(run.tokens, theirs, lengths):
            assert got == want[:n], f"{run.label}: engine {got}, transformers {want[:n]}"
        assert run.blocks_in_use == 0 and run.cached_tokens > 0, run
    static, continuous = runs[-2], runs[-1]
    assert continuous.decode_steps < static.decode_steps  # the seat freed by the 2-token request is reused


@pytest.mark.skipif(runtime.on_gpu(), reason="float32 token-for-token parity: an interpreter check")
def test_the_plain_rung_calls_no_lessonlib_kernel(path, monkeypatch):
    from lessonlib import ops
    from lessonlib.engine.features import PLAIN_PYTORCH

    def refuse(*args, **kwargs):
        raise AssertionError("a lessonlib kernel ran with every feature off")

    for name in ("add_rms_norm", "rope_store_kv", "swiglu", "flash_attention", "paged_attention",
                 "paged_prefill_attention", "argmax", "gemv"):
        monkeypatch.setattr(ops, name, refuse)
    plain = LLM(model=str(path), dtype=DTYPE, max_num_seqs=2, max_model_len=128,
                features=PLAIN_PYTORCH)
    prompts = ["Hello, my name is", PREFIX]
    outs = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert_same_tokens(outs, transformers_greedy(path, prompts, 3), prompts)


def test_features_are_checked_and_check_kernels_turns_graphs_off(path):

    with pytest.raises(TypeError, match="fused_ops must be a bool"):
        Features(fused_ops=1)
    with pytest.raises(TypeError, match="features must be"):
        LLM(model=str(path), dtype=DTYPE, features={"fused_ops": False})
    eager = LLM(model=str(path), dtype=DTYPE, max_num_seqs=2, max_model_len=64, check_kernels=True,
                features=Features(fused_ops=False))
    assert eager.features == Features(fused_ops=False, cuda_graphs=False) and not eager.cuda_graphs


@pytest.mark.skipif(not runtime.on_gpu(), reason="CUDA graphs need a GPU")
def test_every_rung_on_the_gpu_gives_the_same_tokens(path):
    from lessonlib.cases.serving_engine import ladder, run_ladder

    # The GPU rungs, "+ CUDA graphs" included, and gather-then-SDPA decode replayed from graphs (not a rung: it
    # checks that path captures, with the whole block table and padding rows). In 16 bits each rung sums in its own
    # order, so a rung may part from the top rung at a near-tie (measured in float64, as lesson 07's live ladder does);
    # anything wider, or a block left in use, raises.
    from lessonlib.cases.serving_engine import show_live_ladder

    prompts = ["Hello, my name is", PREFIX, "The capital of France is Paris."]  # 3 rows: the graph of 4 pads one
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 8, 5)]
    rungs = [*ladder(), ("gather then SDPA, CUDA graphs", Features(paged_decode=False))]
    runs = run_ladder(str(path), prompts, params, rungs=rungs, dtype=DTYPE, max_num_seqs=4, max_model_len=256)
    show_live_ladder(runs, runs[-2].tokens, model_path=path, prompts=prompts, dtype=DTYPE)  # against everything on


def test_decode_inputs_travel_in_one_copy_and_pad_the_rows_past_the_batch():
    """What a captured decode graph reads: each sequence's last token (or the previous step's row that holds it),
    its position and slot, its length and block table, all in one buffer; rows past the batch point at the padding
    block."""
    from lessonlib.engine.llm import PENDING
    from lessonlib.engine.model_runner import DecodeBuffers
    from lessonlib.engine.sequence import Sequence

    inputs = DecodeBuffers(rows=4, max_blocks=3, pad_block=9, block_size=16, device=torch.device("cpu"))
    a = Sequence(list(range(1, 18)), GREEDY, block_table=[5, 2])  # 17 tokens: the last in block 2, offset 0
    b = Sequence([7] * 3, GREEDY, block_table=[4])
    views = inputs.fill([a, b], rows=3, previous_rows=[None, None])
    assert inputs.input_ids(3).tolist() == [17, 7, 0] and views["positions"].tolist() == [16, 2, 0]
    assert views["slots"].tolist() == [2 * 16, 4 * 16 + 2, 9 * 16] and views["seq_lens"].tolist() == [17, 3, 1]
    assert views["block_table"][:, :2].tolist() == [[5, 2], [4, 9], [9, 9]]
    # The next step scheduled ahead, for b alone: b's new token has not reached the host (a placeholder there);
    # the step takes it from the row the previous step left it in, on the device. A smaller batch: its padding row
    # no longer holds b's.
    inputs.previous_tokens.copy_(torch.tensor([40, 41, 42, 43]))  # what the previous step computed, row by row
    b.token_ids.append(PENDING)
    views = inputs.fill([b], rows=2, previous_rows=[1])
    assert inputs.input_ids(2).tolist() == [41, 0] and views["positions"].tolist() == [3, 0]
    assert views["slots"].tolist() == [4 * 16 + 3, 9 * 16] and views["seq_lens"].tolist() == [4, 1]
    assert views["block_table"][:, :2].tolist() == [[4, 9], [9, 9]]


def test_the_live_ladder_accepts_a_16_bit_near_tie_and_refuses_a_wrong_token():
    """Lesson 07's live ladder on the H200 (bf16) found it: one rung gave the float64-better of two tokens 0.098
    apart, transformers in bf16 the other (its own bf16 error there: 0.31). In 16 bits such a split is reported as
    a near-tie; a token whose float64 logit is far below is still a wrong answer. In float32 any split raises."""
    from lessonlib.engine.features import PLAIN_PYTORCH
    from lessonlib.cases.serving_engine import RungRun
    from lessonlib.cases.serving_engine import _NearTieJudge, show_live_ladder

    path = tiny_model.build()
    prompt = ("Attention reads every key and value of a sequence for every query. The score matrix grows with the "
              "square of the sequence length, so a paged KV cache")
    judge = _NearTieJudge(path, [prompt], torch.bfloat16)
    with torch.inference_mode():
        ids = torch.tensor([judge.tokenizer(prompt).input_ids], device=judge.truth.device)
        truth = judge.truth(ids).logits[0, -1].double()
    best, second = truth.topk(2).indices.tolist()
    worst = truth.argmin().item()

    def run(token):
        return RungRun("+ fused ops", PLAIN_PYTORCH, [[token, 5]], 1.0, 1, 1, 0, 0)

    gap, allowed = judge(0, [], best, second)
    assert gap < allowed  # the near-tie this prompt has (float64 gap 0.098 here, against a bf16 allowance of ~0.6)
    show_live_ladder([run(best)], [[second, 5]], model_path=path, prompts=[prompt], dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="request 0's tokens"):
        show_live_ladder([run(worst)], [[second, 5]], model_path=path, prompts=[prompt], dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="request 0's tokens"):
        show_live_ladder([run(best)], [[second, 5]])  # float32: no near-tie excuse
