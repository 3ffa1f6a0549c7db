"""Which KV-cache blocks vLLM's block manager holds per request, recorded by wrapping its ``allocate_slots`` while an
in-process engine steps through the requests (the wrapper is removed afterwards)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lessonlib.serving.in_process import scheduler


@dataclass
class BlockTrace:
    """What the engine's block manager held for one request: prompt length, generated tokens, the most blocks it
    held at once, and the block ids at that moment."""

    prompt_tokens: int
    output_tokens: int
    peak_blocks: int
    block_ids: list[int]


def generate_tracing_blocks(llm, prompts: Sequence[str | list[int]], sampling_params) -> tuple[list[str], list[BlockTrace]]:
    """Run ``prompts`` (texts, or lists of token ids) step by step through the engine and record, per request, the
    blocks its KV-cache manager held (the most at once, read after every allocation the scheduler makes).
    Returns the generated texts and the traces, in prompt order."""
    engine, manager = llm.llm_engine, scheduler(llm).kv_cache_manager
    traces: dict[int, BlockTrace] = {}
    allocate = manager.allocate_slots

    def allocate_and_record(request, *args, **kwargs):
        blocks = allocate(request, *args, **kwargs)
        held = manager.get_block_ids(request.request_id)[0]
        trace = traces.setdefault(_index(request.request_id), BlockTrace(len(request.prompt_token_ids), 0, 0, []))
        if len(held) > trace.peak_blocks:
            trace.peak_blocks, trace.block_ids = len(held), list(held)
        return blocks

    for i, prompt in enumerate(prompts):
        engine.add_request(f"lesson-{i}", {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt,
                           sampling_params)
    texts: dict[int, str] = {}
    manager.allocate_slots = allocate_and_record
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    texts[_index(output.request_id)] = output.outputs[0].text
                    traces[_index(output.request_id)].output_tokens = len(output.outputs[0].token_ids)
    finally:
        del manager.allocate_slots  # back to the class's method
    order = sorted(traces)
    return [texts[i] for i in order], [traces[i] for i in order]


def _index(request_id: str) -> int:
    # vLLM appends a suffix to the ids it is given ("lesson-0-3f2a…").
    return int(request_id.split("-")[1])
