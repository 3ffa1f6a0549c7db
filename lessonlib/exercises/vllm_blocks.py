"""Lesson 06's checker (notebook 06_vllm): how many KV-cache blocks vLLM's block manager holds for one request,
checked against the engine itself.
"""

from __future__ import annotations

from lessonlib.exercises._checking import ExerciseFailed, passed


def check_blocks_needed(fn) -> None:
    """``fn(prompt_tokens, max_tokens, block_size)`` predicts how many KV-cache blocks vLLM's block manager holds for
    one request at its peak. Checked against the engine itself: each prediction is compared with the blocks the
    engine's manager really allocated for a request of that many prompt tokens and generated tokens."""
    import random

    from lessonlib import serving

    serving.prepare_vllm()  # before vllm is imported: it imports triton, so Triton's mode must be chosen first
    from vllm import SamplingParams

    llm = serving.engine()
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    rng = random.Random()
    cases = [(block_size, 1), (block_size, 2), (block_size - 1, 2), (1, 1), (1, block_size)]
    cases += [(rng.randrange(1, 4 * block_size), rng.randrange(1, 3 * block_size)) for _ in range(3)]
    prompts = [[rng.randrange(10, 400) for _ in range(prompt_tokens)] for prompt_tokens, _ in cases]
    for (prompt_tokens, max_tokens), prompt in zip(cases, prompts):
        try:
            predicted = fn(prompt_tokens, max_tokens, block_size)
        except NotImplementedError as e:
            raise ExerciseFailed(f"blocks_needed: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        _, [trace] = serving.generate_tracing_blocks(
            llm, [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        if predicted != trace.peak_blocks:
            raise ExerciseFailed(
                f"blocks_needed({prompt_tokens}, {max_tokens}, {block_size}) = {predicted}, but the engine held "
                f"{trace.peak_blocks} blocks for a {prompt_tokens}-token prompt generating {max_tokens} tokens. "
                "Which tokens' K and V does the engine ever write? (Think about the very last token it samples.)")
    passed(f"blocks_needed: correct on {len(cases)} requests, each checked against vLLM's own block manager")
