"""The OpenAI API's request bodies (every field of OpenAI's and vLLM's, each implemented or refused), its error body,
the one mapping from a request onto the engine's ``SamplingParams`` (vLLM's names), and the engine's logprobs in the
API's two shapes.

A field the engine does not implement is refused with a 400 "not supported" when a request sets it to anything but
its default (``UNSUPPORTED``), never accepted and ignored. Token ids are strict ints (a string, float or bool is
refused, not converted). Completions default to 16 tokens (OpenAI's and vLLM's default), chat to what the context
leaves. The bounds the engine needs (logprobs <= 20, n <= 128, token ids in the vocabulary, the context) are the
engine's own checks (``SamplingParams``, ``engine/requests.py``): their ValueError/TypeError becomes the 400.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictInt

from lessonlib.engine.sequence import SamplingParams

# The OpenAI/vLLM request fields that become SamplingParams fields of the same name.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids",
                   "logprobs", "ignore_eos", "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "min_tokens")
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

# Fields of OpenAI's API or vLLM's server this one does not implement, with the value that asks for nothing: a
# request that sets one to anything else gets a 400 "not supported".
UNSUPPORTED = {
    "suffix": None, "best_of": None, "prompt_logprobs": None, "truncate_prompt_tokens": None,
    "allowed_token_ids": None, "bad_words": None, "use_beam_search": False, "length_penalty": 1.0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "structured_outputs": None, "priority": 0,
    "tools": None, "tool_choice": None, "functions": None, "function_call": None, "parallel_tool_calls": None,
    "response_format": None, "audio": None, "modalities": None, "prediction": None, "reasoning_effort": None,
    "web_search_options": None, "store": None, "continue_final_message": False, "chat_template": None,
    "chat_template_kwargs": None, "documents": None, "mm_processor_kwargs": None, "return_tokens_as_token_ids": None,
}
_DEFAULT_TOO = {"response_format": ({"type": "text"},), "modalities": (["text"],), "tool_choice": ("none",),
                "store": (False,), "tools": ([],), "parallel_tool_calls": (True, False)}


class ApiError(Exception):
    """An error the client caused: answered with ``status`` and an OpenAI-style body; the server carries on."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields (user, metadata, ...) are accepted and ignored, as vLLM

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    echo: bool = False


class CompletionRequest(_Request):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


def refuse_unsupported(request: _Request) -> None:
    """A 400 for the first field set that the server does not implement (``UNSUPPORTED``), and for the field
    combinations vLLM refuses."""
    extra = request.model_extra or {}
    for name, default in UNSUPPORTED.items():
        value = extra.get(name, default)
        if name == "best_of" and value == (request.n or 1):  # best_of n of n samples: n samples
            continue
        if value != default and value not in _DEFAULT_TOO.get(name, ()):
            raise ApiError(f"'{name}' is not supported by this server", param=name, code="not_supported")
    if request.stream_options is not None and not request.stream:
        raise ApiError("stream_options can only be set when stream is true", param="stream_options")
    if request.echo and isinstance(request, ChatCompletionRequest):
        raise ApiError("'echo' is not supported by this server's chat completions", param="echo",
                       code="not_supported")
    if request.echo and request.logprobs is not None:
        raise ApiError("'echo' with 'logprobs' (the prompt's logprobs) is not supported by this server",
                       param="echo", code="not_supported")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: JSON keys are strings of token ids."""
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise ApiError("logit_bias keys must be token ids (strings of integers)", param="logit_bias") from None


def sampling_params(request: _Request, prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """The request's SamplingParams; raises ApiError (400) for a value the engine refuses."""
    values = {name: getattr(request, name, None) for name in SAMPLING_FIELDS}
    values["logit_bias"] = _logit_bias(request.logit_bias)
    room = max_model_len - prompt_tokens
    if room < 1:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                       f"{prompt_tokens} tokens (one more is needed for the completion). Please reduce the length.",
                       param="prompt", code="context_length_exceeded")
    if isinstance(request, ChatCompletionRequest):
        asked = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        values["max_tokens"] = room if asked is None else asked  # vLLM's default: what the context leaves
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError("top_logprobs needs logprobs set to true", param="top_logprobs")
        values["logprobs"] = (request.top_logprobs or 0) if request.logprobs else None
    elif values["max_tokens"] is None:
        values["max_tokens"] = min(COMPLETION_MAX_TOKENS, room)
    if isinstance(values["max_tokens"], int) and values["max_tokens"] > room:
        raise ApiError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{values['max_tokens'] + prompt_tokens} tokens ({prompt_tokens} in the prompt, "
                       f"{values['max_tokens']} in the completion). Please reduce the length.", param="max_tokens")
    try:
        return SamplingParams(**{name: value for name, value in values.items() if value is not None})
    except (TypeError, ValueError) as error:
        raise ApiError(str(error), param=field_named_in(str(error))) from None


def field_named_in(message: str) -> str | None:
    """The request field an engine error message starts with (the engine names the field first)."""
    return next((name for name in (*SAMPLING_FIELDS, "prompt") if message.startswith(name)), None)


def chat_turns(messages: list[ChatMessage]) -> list[dict]:
    """The conversation as the chat template reads it: text content only (a list of text parts joined)."""
    if not messages:
        raise ApiError("messages must hold at least one message", param="messages")
    turns = []
    for message in messages:
        content = message.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if any(part.get("type") != "text" or not isinstance(part.get("text", ""), str) for part in content):
                raise ApiError("only text content is supported", param="messages", code="not_supported")
            content = "".join(part.get("text", "") for part in content)
        turns.append({"role": message.role, "content": content or ""})
    return turns


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
