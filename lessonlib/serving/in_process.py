"""The one in-process vLLM engine of lesson 06: start it, reuse it while the settings match, shut it down, look
inside it (its scheduler, its attention backends).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the notebook can read its scheduler
and block manager. One engine lives at a time (:func:`engine`): on a GPU vLLM refuses to start a second while the
first holds its ``gpu_memory_utilization`` share of the memory.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from contextlib import contextmanager

import torch

from lessonlib.serving.settings import choose_model, engine_settings, require_vllm


def start_engine(model: str | None = None, block_size: int | None = None, **overrides):
    """A new ``vllm.LLM`` in this process, with :func:`engine_settings`; caches inside the course's scratch folder.
    :func:`engine` is what the lesson uses (one engine at a time); this starts one regardless, e.g. to show a
    configuration that vLLM refuses before it allocates anything (block_size=16 on CPU)."""
    require_vllm()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    with _without_numa_notice():
        return LLM(**{**engine_settings(model or choose_model(), block_size), **overrides})


NUMA_NOTICE = "NUMA binding: Using"  # vLLM's CPU worker, binding its memory: "... Using MEMBIND policy ..."


@contextmanager
def _without_numa_notice():
    """Start an engine with every line it writes to stderr passed on but one: on CPU, vLLM's worker binds its memory
    to a NUMA node and says so in a 220-character line at each start (a C++ TORCH_WARN from its
    ``init_cpu_memory_env``, written straight to file descriptor 2: no Python warning filter or vLLM log level
    reaches it, and PyTorch reads TORCH_CPP_LOG_LEVEL only when it loads). Nothing a student acts on; JupyterLab
    would break it across three lines. The rest of fd 2 (and all of ``sys.stderr``) is shown as written."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if NUMA_NOTICE not in line:
                    sys.stderr.write(line)
            sys.stderr.flush()


_running: tuple[dict, object] | None = None  # (settings, engine) of the one engine this process holds


def engine(**overrides):
    """This process's one in-process engine: this machine's settings (:func:`engine_settings`) with ``overrides``
    (e.g. ``dtype="float32"``), for the notebook, its exercise checkers and the tests. Asked for the same settings
    again it returns the same engine; asked for others, it shuts the running one down (:func:`shutdown`) before
    starting the next, since vLLM refuses a second engine on a GPU while the first holds its share of the memory."""
    global _running
    model, block_size = overrides.pop("model", None), overrides.pop("block_size", None)
    settings = {**engine_settings(model or choose_model(), block_size), **overrides}
    if _running is not None:
        if _running[0] == settings:
            return _running[1]
        previous, _running = _running[1], None
        shutdown(previous)
    _running = settings, start_engine(**settings)
    return _running[1]


def shutdown(llm) -> None:
    """Stop an in-process engine and give its memory back: its worker, weights and KV cache, and (on a GPU) the
    cached blocks, to the driver, where the next engine measures what is free. ``llm`` is unusable afterwards; it
    keeps nothing alive, so a notebook variable still naming it holds no memory."""
    llm.llm_engine.engine_core.shutdown()  # the engine core's own teardown: workers, distributed state
    llm.llm_engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _layer_backends(worker) -> dict[str, str]:
    """Runs inside vLLM's worker (through collective_rpc): the attention backend of every attention layer."""
    layers = worker.model_runner.vllm_config.compilation_config.static_forward_context
    return {name: layer.attn_backend.get_name() for name, layer in layers.items() if hasattr(layer, "attn_backend")}


def attention_backends(llm) -> dict[str, str]:
    """{layer name: backend} as the engine's worker really runs them (not as requested)."""
    return llm.collective_rpc(_layer_backends)[0]


def scheduler(llm):
    """The engine's scheduler (in-process engines only): its ``kv_cache_manager`` holds the block tables."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine runs in another process; start it with engine() to look inside")
    return core.scheduler
