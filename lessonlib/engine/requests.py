"""A request's one way in: its prompt tokenized and checked, its sampling parameters checked against the model, and
its ``n`` seeded sequences made. ``LLM.generate``, ``LLM.add_request``, ``LLM.chat`` and the server (through
``AsyncLLM``) all come through here, so a request is refused before anything is queued, by the same rules
everywhere; nothing here changes the engine's state.

    ids, text = prompt_ids(prompt, tokenizer, max_chars)       # a str, a list of token ids or {"prompt_token_ids"}
    seqs = make_sequences(prompt, params, limits, tokenizer)   # the n samples, the i-th seeded seed + i
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

from lessonlib.engine.sequence import SamplingParams, Sequence


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the vocabulary, the longest sequence, the longest prompt text."""

    vocab_size: int
    max_model_len: int
    max_prompt_chars: int  # longer text cannot fit max_model_len tokens: refused before it is tokenized


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token stands for: its longest vocabulary entry (byte-level BPE writes a
    byte as one character, SentencePiece a character as one), so ``max_model_len`` times it bounds a prompt that
    fits, and a longer text is refused without the cost of tokenizing it."""
    if tokenizer is None:
        return 1
    return max(len(piece) for piece in tokenizer.get_vocab())


def tokenize(tokenizer, text: str, max_chars: int, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids; refused first if it is longer than ``max_chars`` or is not valid Unicode (a lone
    surrogate, which JSON can carry)."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: pass token ids ({'prompt_token_ids': [...]})")
    if len(text) > max_chars:
        raise ValueError(f"prompt of {len(text)} characters cannot fit the context: at most {max_chars} characters "
                         "(max_model_len tokens of the longest token's text)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"the prompt is not valid Unicode: {error.reason} at character {error.start}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """``ids`` as a list of ints, each a token of the vocabulary; strings, floats and bools are refused (not
    converted), ints of any integer type (numpy's, torch's) accepted."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    out = []
    for token in ids:
        if isinstance(token, bool):
            raise TypeError(f"{name}: token ids are ints, got {token!r}")
        try:
            out.append(operator.index(token))
        except TypeError:
            raise TypeError(f"{name}: token ids are ints, got {token!r}") from None
    if out and (min(out) < 0 or max(out) >= vocab_size):
        raise ValueError(f"{name}: token id out of range: the vocabulary has {vocab_size} tokens")
    return out


def prompt_ids(prompt, tokenizer, limits: RequestLimits) -> tuple[list[int], str | None]:
    """A prompt (text, a list of token ids, or {"prompt_token_ids": [...], "prompt": its text}) as its checked
    token ids and its text (None when given as ids alone)."""
    text = prompt.get("prompt") if isinstance(prompt, dict) else None  # LLM.chat's rendered text
    if isinstance(prompt, str):
        text, ids = prompt, tokenize(tokenizer, prompt, limits.max_prompt_chars)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
    elif isinstance(prompt, (list, tuple)):
        ids = prompt
    else:
        raise TypeError(f"a prompt is a str, a list of token ids or a dict with 'prompt_token_ids', got "
                        f"{type(prompt).__name__}")
    ids = token_ids("prompt", ids, limits.vocab_size)
    if not ids:
        raise ValueError("empty prompt: a prompt needs at least one token")
    if len(ids) >= limits.max_model_len:
        raise ValueError(f"prompt of {len(ids)} tokens is longer than the cache can hold: at most "
                         f"{limits.max_model_len - 1} (max_model_len {limits.max_model_len}: the prompt and one new "
                         "token)")
    return ids, text


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """The checks SamplingParams cannot make alone: every token it names is in the vocabulary, and no more logprobs
    are asked than there are tokens."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(f"logprobs must be at most the vocabulary's {vocab_size} tokens, got {params.logprobs}")
    token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    token_ids("logit_bias", [token for token, _ in params.logit_bias], vocab_size)


def sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of a request's ``n`` samples: one sequence, seeded ``seed + i`` (the first keeps ``seed``; None
    stays None: each draws its own random seed)."""
    seed = params.seed if params.seed is None or i == 0 else (params.seed + i) % 2**64
    return replace(params, n=1, seed=seed)


def make_sequences(prompt, params: SamplingParams, limits: RequestLimits, tokenizer) -> list[Sequence]:
    """A request's ``n`` sequences, checked (prompt once, parameters once); nothing is queued here."""
    check_params(params, limits.vocab_size)
    ids, text = prompt_ids(prompt, tokenizer, limits)
    return [Sequence(list(ids), sample_params(params, i), prompt=text) for i in range(params.n)]
