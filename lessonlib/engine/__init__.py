"""A small serving engine built from the course's kernels, with vLLM's offline interface (lesson 07).

    from lessonlib.engine import LLM, SamplingParams
    llm = LLM(model=path)                      # a local Llama or Qwen2 checkpoint folder
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))
    outs[i].outputs[0].token_ids, outs[i].outputs[0].text

The folder tree is the architecture (nano-vllm's layout):

    config.py          what config.json says, checked (supported architectures, RoPE type)
    features.py        one switch per speed-up (fused ops, FlashAttention prefill, paged decode, CUDA graphs,
                       continuous batching): lesson 07's tokens/s ladder
    sequence.py        SamplingParams, a request's state (Sequence), the outputs
    block_manager.py   which KV blocks each sequence holds; prefix caching (lesson 03's allocator)
    scheduler.py       continuous batching: admission, decode, preemption
    model.py           the decoder on lessonlib.ops kernels; loading safetensors weights
    model_runner.py    packed step inputs, the KV pools, CUDA graphs per batch-size bucket
    sampler.py         greedy, temperature, top-p, seeded
    llm.py             LLM: generate(), add_request()/step()/abort_request()
    async_llm.py       AsyncLLM: an asyncio front, one stream of outputs per request, abort
    serve/             an OpenAI-compatible HTTP server over AsyncLLM (imports the engine; the engine never imports it)
"""

from lessonlib.engine.config import ModelConfig
from lessonlib.engine.features import Features, ladder
from lessonlib.engine.llm import LLM, StepRecord
from lessonlib.engine.sampler import top_p_filter
from lessonlib.engine.scheduler import can_admit
from lessonlib.engine.sequence import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "Features", "ladder", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig",
           "StepRecord", "top_p_filter", "can_admit"]
