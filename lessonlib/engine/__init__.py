"""A small serving engine built from the course's kernels, with vLLM's offline interface (lesson 07).

    from lessonlib.engine import LLM, SamplingParams
    llm = LLM(model=path)  # a local Llama (3.x), Qwen2, Qwen3 or Mistral checkpoint folder
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))
    outs[i].outputs[0].token_ids, outs[i].outputs[0].text

The folder tree is the architecture (nano-vllm's layout):

    config.py          what config.json says, checked (architectures, RoPE type and llama3
                       scaling, every field whose math is not implemented refused by name)
    features.py        one switch per speed-up (fused ops, FlashAttention prefill, paged decode,
                       CUDA graphs, continuous batching): the rungs of lesson 07's tokens/s
                       ladder; chunked prefill
    sequence.py        SamplingParams, a request's state (Sequence), the outputs
    requests.py        a request's one way in: prompt tokenized and checked, params checked
                       against the model, its n seeded sequences (LLM.generate, add_request, chat
                       and the server all come through here)
    block_manager.py   which KV blocks each sequence holds; prefix caching (lesson 03's allocator)
    scheduler.py       continuous batching: admission, decode, preemption, chunked prefill
    model.py           the decoder on lessonlib.ops kernels; loading safetensors weights (matched
                       by name and shape)
    model_runner.py    packed step inputs, the KV pools, CUDA graphs per batch-size bucket
    sampler.py         logit bias, min tokens, penalties; greedy; temperature, min-p, top-k, top-p,
                       seeded; NaN/inf rows refused; a row whose sampling fails ends its request
                       alone; logprobs
    outputs.py         sequences to RequestOutputs, finished or streamed: stop strings on the
                       text (held back while a stream runs), logprobs, n samples
    chat.py            LLM.chat: conversations rendered with the chat template
    checks.py          check_kernels=True: block tables and slots checked before each step's kernels
    llm.py             LLM: generate(), chat(), add_request()/step()/abort_request()
    async_llm.py       AsyncLLM: an asyncio front, one stream of outputs per request, abort
    serve/             an OpenAI-compatible HTTP server over AsyncLLM (imports the engine; the
                       engine never imports it)

The engine alone: what lesson 07 runs on it (the tokens/s ladder, the scheduler simulation, the
live checks) is in ``lessonlib.cases.serving_engine``, what it draws in
``lessonlib.plots.serving_engine``. Nothing here imports ``lessonlib.plots``, ``results``,
``widgets`` or ``serving`` (a test of the code's shape checks).
"""

from lessonlib.engine.config import ModelConfig
from lessonlib.engine.features import Features
from lessonlib.engine.llm import LLM, StepRecord
from lessonlib.engine.sampler import min_p_filter, top_k_filter, top_p_filter
from lessonlib.engine.scheduler import can_admit, prompt_chunks
from lessonlib.engine.sequence import CompletionOutput, Logprob, RequestOutput, SamplingParams

__all__ = ["LLM", "Features", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig",
           "StepRecord", "top_p_filter", "top_k_filter", "min_p_filter", "can_admit", "prompt_chunks", "Logprob"]
