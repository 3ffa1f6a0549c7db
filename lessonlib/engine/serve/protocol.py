"""The OpenAI API's request bodies (the fields this server reads), its error body, the one mapping from a request
onto the engine's ``SamplingParams`` (vLLM's names), and the engine's logprobs in the API's two shapes.

A sampling field the engine's ``SamplingParams`` does not have yet is refused with a 400 "not supported" when the
request sets it; once ``SamplingParams`` gains a field of that name, it passes through here unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict

from lessonlib.engine.sequence import SamplingParams

# The OpenAI/vLLM request fields that become SamplingParams fields of the same name.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids",
                   "logprobs", "ignore_eos")


class ApiError(Exception):
    """An error the client caused: answered with ``status`` and an OpenAI-style body; the server carries on."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields of the API this server ignores (user, ...) are accepted

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _requested(name: str, value) -> bool:
    """Whether a request asks for something by this field (an absent, empty or default value asks nothing)."""
    absent = value is None or value is False or (isinstance(value, (list, str)) and not value)  # logprobs=0 asks
    return not absent and not (name == "n" and value == 1)


def sampling_params(request: _Request, prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """The request's SamplingParams; raises ApiError (400) for a field the engine lacks or a value it refuses."""
    have = {f.name for f in dataclasses.fields(SamplingParams)}
    values = {name: getattr(request, name, None) for name in SAMPLING_FIELDS}
    if isinstance(request, ChatCompletionRequest):
        values["max_tokens"] = request.max_completion_tokens or request.max_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError("top_logprobs needs logprobs set to true", param="top_logprobs")
        values["logprobs"] = (request.top_logprobs or 0) if request.logprobs else None
    if isinstance(values["stop"], str):
        values["stop"] = [values["stop"]]
    room = max_model_len - prompt_tokens
    if values["max_tokens"] is None:
        values["max_tokens"] = room  # vLLM's default: as many as the context leaves
    elif values["max_tokens"] > room:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{values['max_tokens'] + prompt_tokens} tokens ({prompt_tokens} in the prompt, "
                       f"{values['max_tokens']} in the completion). Please reduce the length.", param="max_tokens")
    kwargs = {}
    for name, value in values.items():
        if name in have and value is not None:
            kwargs[name] = value
        elif _requested(name, value):
            raise ApiError(f"'{name}' is not supported by this server yet", param=name, code="not_supported")
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as error:
        raise ApiError(str(error), param=_field_named_in(str(error))) from None


def _field_named_in(message: str) -> str | None:
    return next((name for name in SAMPLING_FIELDS if message.startswith(name)), None)


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    """The prompt text of a conversation: the checkpoint's chat template, or ChatML (Qwen2's format, whose
    ``<|im_start|>``/``<|im_end|>`` tokens the course's tiny model has) when it has none."""
    turns = []
    for message in messages:
        content = message.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(part.get("type") != "text" for part in content):
                raise ApiError("only text content is supported", param="messages")
            content = "".join(part.get("text", "") for part in content)
        turns.append({"role": message.role, "content": content or ""})
    if tokenizer is None:
        raise ApiError("this checkpoint has no tokenizer: chat needs one", param="messages")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    text = "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns)
    return text + "<|im_start|>assistant\n"


def token_text(tokenizer, token: int, logprob) -> str:
    """A token as the API names it: its text (the engine's ``decoded_token``), or ``token_id:N`` without a tokenizer
    (vLLM's spelling)."""
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def completion_logprobs(tokenizer, ids: list[int], entries: list[dict], offset: int) -> tuple[dict, int]:
    """Completions' shape for the tokens ``ids`` and their engine entries ({token: Logprob}, the chosen token and the
    ``logprobs`` most likely): ``tokens``, ``token_logprobs``, ``top_logprobs`` (each entry, as vLLM: the chosen token
    among them) and ``text_offset`` (from ``offset``, where the first token's text starts); and the next offset."""
    shape = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(ids, entries):
        text = token_text(tokenizer, token, entry[token])
        shape["tokens"].append(text)
        shape["token_logprobs"].append(entry[token].logprob)
        shape["top_logprobs"].append({token_text(tokenizer, t, lp): lp.logprob for t, lp in entry.items()})
        shape["text_offset"].append(offset)
        offset += len(text)
    return shape, offset


def chat_logprobs(tokenizer, ids: list[int], entries: list[dict], top: int) -> list[dict]:
    """Chat's ``logprobs.content`` for the tokens ``ids``: each token, its logprob and UTF-8 bytes, and its
    ``top_logprobs``: the ``top`` most likely tokens by rank (the chosen one only if it is among them)."""
    content = []
    for token, entry in zip(ids, entries):
        best = sorted(((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= top), key=lambda x: x[0])[:top]
        content.append({**_chat_token(tokenizer, token, entry[token]),
                        "top_logprobs": [_chat_token(tokenizer, t, lp) for _, t, lp in best]})
    return content


def _chat_token(tokenizer, token: int, logprob) -> dict:
    text = token_text(tokenizer, token, logprob)
    return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode("utf-8"))}
