"""Greedy parity: vLLM's greedy tokens against Hugging Face transformers' ``generate`` on the same model and dtype,
and, where they part, how close the call was (a near-tie of the two best logits); lesson 07's engine against
transformers' full forward (no KV cache), the oracle that long prompts need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lessonlib import runtime


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
            # attention_mask given: else generate masks a pad token found in the prompt (benchmarks/experiments/generate_oracle.py)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
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


def near_tie_gap(truth: torch.Tensor, low: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> tuple[float, float]:
    """Two greedy decodings part here: one picks token ``a``, the other ``b``, after the same context. ``truth``: the
    float64 logits there; ``low``: transformers' logits there in the decodings' 16-bit ``dtype``. Returns (gap,
    allowed): the float64 gap between the two tokens' logits, and what rounding in ``dtype`` allows at this position
    (:func:`lessonlib.testing.tolerance`, from transformers' own error against float64 here). A **near-tie** when
    gap <= allowed. The gap is infinite when neither token is within ``allowed`` of the float64 best: then both
    decodings are wrong, not close."""
    from lessonlib.testing import tolerance

    truth, low = truth.double(), low.double()
    allowed = tolerance(truth, low, dtype)
    if max(truth[a], truth[b]) < truth.max() - allowed:
        return float("inf"), allowed
    return abs(truth[a] - truth[b]).item(), allowed


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


def full_forward_greedy(model_path, prompts: Sequence[Sequence[int]], max_tokens: int,
                        dtype: torch.dtype = torch.float64) -> list[list[int]]:
    """transformers' greedy continuations of token-id prompts with no KV cache: one forward of the whole sequence
    per new token, the argmax of its last position's logits, on the CPU (float64 by default: the truth). The
    oracle for an engine: ``generate``, with its KV cache and an attention mask it infers from pad tokens found in
    the prompt, can part from its own model's forward (benchmarks/experiments/generate_oracle.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
    continuations = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
            continuations.append(ids[len(prompt):])
    return continuations


def check_engine_greedy(llm, model_path, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Lesson 07's engine (``lessonlib.engine.LLM``) against :func:`full_forward_greedy` on the same checkpoint:
    in float32 the engine's greedy tokens must equal transformers' full-forward tokens, token for token. In a
    16-bit dtype (a GPU) they may part only at a near-tie (:func:`near_tie_gap`, transformers' own logits in that
    dtype against float64 at the same context); the rest of that request is then not compared. Raises
    AssertionError at the first other difference; returns the engine's tokens."""
    from lessonlib.engine import SamplingParams

    outs = llm.generate([list(p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                  ignore_eos=True))
    ours = [list(out.outputs[0].token_ids) for out in outs]
    theirs = full_forward_greedy(model_path, prompts, max_tokens)
    for prompt, a, b in zip(prompts, ours, theirs):
        position = first_difference(a, b)
        if position is None:
            continue
        where = (f"prompt of {len(prompt)} tokens: the engine and transformers' full forward part at generated "
                 f"token {position}: {a[position:position + 4]} vs {b[position:position + 4]}")
        if llm.dtype.itemsize > 2 or position >= min(len(a), len(b)):
            raise AssertionError(where)
        gap, allowed = _gap_at(model_path, list(prompt) + a[:position], a[position], b[position], llm.dtype)
        if gap > allowed:
            raise AssertionError(f"{where}; not a near-tie in {llm.dtype}: the float64 logits are {gap:.3g} apart, "
                                 f"rounding allows {allowed:.3g}")
    return ours


def _gap_at(model_path, ids: list[int], a: int, b: int, dtype: torch.dtype) -> tuple[float, float]:
    """:func:`near_tie_gap` after the context ``ids``: transformers' float64 and ``dtype`` logits there."""
    logits = []
    for kind in (torch.float64, dtype):
        model = _hf_model(str(model_path), kind)[1]
        with torch.inference_mode():
            logits.append(model(torch.tensor([ids], device=model.device), use_cache=False).logits[0, -1])
    return near_tie_gap(logits[0], logits[1], a, b, dtype)
