"""The OpenAI-compatible routes (FastAPI), over an ``AsyncLLM``.

    POST /v1/completions, /v1/chat/completions   one prompt (or conversation) each, ``n`` choices, ``logprobs``;
                                                 ``stream`` sends server-sent events (``data: {...}`` per choice per
                                                 step with new tokens, naming its index; ``data: [DONE]``)
    GET  /v1/models, /health, /metrics

Every refusal is a 4xx with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``, raised before
the engine sees the request; the server carries on. A client that disconnects cancels its request: a stream's
generator is cancelled by Starlette, a plain request's by the watch in :func:`_unless_disconnected`; either way the
request is aborted and its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lessonlib.engine.async_llm import AsyncLLM
from lessonlib.engine.serve.metrics import Metrics
from lessonlib.engine.serve.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                             chat_prompt, completion_logprobs, sampling_params)

DISCONNECT_POLL_S = 0.25  # how often a plain (non-streaming) request checks that its client is still there


def build_app(engine: AsyncLLM, model_name: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await engine.shutdown()  # every running request aborted, the stepping task and its thread stopped

    app = FastAPI(title="lessonlib engine (OpenAI-compatible)", lifespan=lifespan)
    app.state.engine, app.state.model_name = engine, model_name
    app.state.metrics = metrics = Metrics(engine, model_name)

    @app.exception_handler(ApiError)
    async def api_error(_request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        kind = first.get("type")
        message = "the body is not valid JSON" if kind == "json_invalid" else f"{where}: {first.get('msg')}"
        return JSONResponse(ApiError(message, param=where).body(), status_code=400)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "lessonlib", "max_model_len": engine.llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError("one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        return await _serve(request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(request, body, chat_prompt(engine.llm.tokenizer, body.messages), chat=True)

    return app


async def _serve(request: Request, body, prompt, chat: bool):
    """Check the request, then answer it streamed or whole."""
    state = request.app.state
    engine: AsyncLLM = state.engine
    if body.model != state.model_name:
        raise ApiError(f"The model `{body.model}` does not exist.", status=404, type="NotFoundError",
                       param="model", code="model_not_found")
    ids = _prompt_ids(engine, prompt)
    params = sampling_params(body, len(ids), engine.llm.max_model_len)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    outputs = engine.generate({"prompt_token_ids": ids}, params, request_id)  # starts on its first iteration
    stream = _Answer(request_id, state, chat, len(ids), time.perf_counter(), params)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream.events(outputs, usage), media_type="text/event-stream")
    return JSONResponse(await _unless_disconnected(request, stream.whole(outputs)))


def _prompt_ids(engine: AsyncLLM, prompt) -> list[int]:
    """The prompt's token ids, checked as the engine checks them (range, length) so a refusal is a 400."""
    llm = engine.llm
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            raise ApiError("this checkpoint has no tokenizer: send the prompt as token ids", param="prompt")
        ids = llm.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
    if not ids:
        raise ApiError("the prompt is empty", param="prompt")
    if min(ids) < 0 or max(ids) >= llm.config.vocab_size:
        raise ApiError(f"token id out of range: the vocabulary has {llm.config.vocab_size} tokens", param="prompt")
    if len(ids) >= llm.max_model_len:
        raise ApiError(f"This model's maximum context length is {llm.max_model_len} tokens. However, your prompt has "
                       f"{len(ids)} tokens (one more is needed for the completion). Please reduce the length.",
                       param="prompt", code="context_length_exceeded")
    return ids


async def _unless_disconnected(request: Request, work):
    """Await ``work``; cancel it (which aborts its request) if the client goes away first."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise ApiError("the client disconnected", status=499, code="client_closed_request")


@dataclass
class _Choice:
    """What one of a request's ``n`` choices has sent so far."""

    tokens: int = 0  # its output tokens
    text: str = ""
    offset: int = 0  # completions' text_offset of its next logprobs token
    finish: str | None = None
    logprobs: list = field(default_factory=list)  # every logprobs piece sent (completions: dicts; chat: entries)


class _Answer:
    """One request's answer: the deltas of its cumulative outputs, as OpenAI's chunks (each naming its choice's
    index) or one response with its ``n`` choices."""

    def __init__(self, request_id: str, state, chat: bool, prompt_tokens: int, arrived: float, params):
        self.id, self.model, self.chat = request_id, state.model_name, chat
        self.tokenizer = state.engine.llm.tokenizer
        self.metrics: Metrics = state.metrics
        self.prompt_tokens, self.arrived, self.created = prompt_tokens, arrived, int(time.time())
        self.top = params.logprobs  # None: no logprobs asked
        self.choices = [_Choice() for _ in range(params.n)]
        self.last = None
        self.metrics.prompt.inc(prompt_tokens)

    def _deltas(self, out) -> list[tuple[int, str, object, str | None]]:
        """Per choice with something new: (index, the text not sent yet (a trailing partial UTF-8 character held
        back until it completes), the new tokens' logprobs or None, its finish reason once it finished); records the
        new tokens' timing."""
        now, deltas = time.perf_counter(), []
        new = sum(len(c.token_ids) - self.choices[c.index].tokens for c in out.outputs)
        self.metrics.tokens(self.arrived, self.last, now, new)
        self.last = now if new > 0 else self.last
        for completion in out.outputs:
            choice = self.choices[completion.index]
            ids = completion.token_ids[choice.tokens:]
            logprobs = None if self.top is None else self._logprobs(choice, ids, completion.logprobs[choice.tokens:])
            choice.tokens = len(completion.token_ids)
            text = completion.text or ""
            if completion.finish_reason is None:
                text = text.rstrip("\ufffd")
            delta, choice.text = text[len(choice.text):], max(text, choice.text, key=len)
            finish = completion.finish_reason if choice.finish is None else None  # named once
            choice.finish = choice.finish or completion.finish_reason
            if delta or ids or finish:
                deltas.append((completion.index, delta, logprobs, finish))
        if out.finished:
            self.metrics.finished.labels(**self.metrics.labels, finished_reason=self.choices[0].finish).inc()
        return deltas

    def _logprobs(self, choice: _Choice, ids: list[int], entries: list[dict]):
        if self.chat:
            piece = {"content": chat_logprobs(self.tokenizer, ids, entries, self.top)}
            choice.logprobs += piece["content"]
        else:
            piece, choice.offset = completion_logprobs(self.tokenizer, ids, entries, choice.offset)
            choice.logprobs.append(piece)
        return piece

    def _usage(self) -> dict:
        completion_tokens = sum(choice.tokens for choice in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _chunk(self, index: int | None, delta: str | None, logprobs=None, finish: str | None = None,
               first: bool = False) -> dict:
        if index is None:  # the usage chunk
            choices = []
        elif self.chat:
            message = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
            choices = [{"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish}]
        else:
            choices = [{"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}]
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}

    async def events(self, outputs, usage: bool):
        """Server-sent events: a chunk per choice per step that gave it new tokens or finished it, then usage (if
        asked), [DONE]."""
        try:
            if self.chat:
                for index in range(len(self.choices)):
                    yield _sse(self._chunk(index, None, first=True))
            async for out in outputs:
                for index, delta, logprobs, finish in self._deltas(out):
                    yield _sse(self._chunk(index, delta, logprobs, finish))
        finally:  # a client that went away: its request is aborted as ``outputs`` closes (AsyncLLM.num_aborted)
            await outputs.aclose()
        if usage:
            yield _sse({**self._chunk(None, None), "usage": self._usage()})
        yield "data: [DONE]\n\n"

    async def whole(self, outputs) -> dict:
        async for out in outputs:
            self._deltas(out)
        choices = []
        for index, choice in enumerate(self.choices):
            logprobs = None if self.top is None else self._whole_logprobs(choice)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                                "logprobs": logprobs, "finish_reason": choice.finish})
            else:
                choices.append({"index": index, "text": choice.text, "logprobs": logprobs,
                                "finish_reason": choice.finish})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self._usage()}

    def _whole_logprobs(self, choice: _Choice) -> dict:
        if self.chat:
            return {"content": choice.logprobs}
        return {key: [x for piece in choice.logprobs for x in piece[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
