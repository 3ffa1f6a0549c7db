"""The OpenAI-compatible routes (FastAPI), over an ``AsyncLLM``.

    POST /v1/completions, /v1/chat/completions   one prompt (or conversation) each, ``n`` choices, ``logprobs``;
                                                 ``stream`` sends server-sent events (``data: {...}`` per choice per
                                                 step with new tokens, naming its index; ``data: [DONE]``)
    GET  /v1/models, /health, /metrics

One request never harms another. Every refusal is a 4xx with OpenAI's error body ``{"error": {"message", "type",
"param", "code"}}`` (a bad field, an unknown model 404, a wrong method 405, an unknown route 404, a body over
``max_body_bytes`` 413, a body that is not UTF-8 JSON 400), raised before the engine sees the request: the checks
are the engine's own (``LLM.make_sequences``), run with the tokenization and the chat template's rendering in a
worker thread, so a long prompt never stalls the event loop (``/health``, the other streams). A request the engine
ends alone ("abort": its sampling failed) gets an error event and ``[DONE]`` (streamed) or a 500 (whole); so does
every stream when the server shuts down. A client that disconnects cancels its request: a stream's generator is
cancelled by Starlette, a plain request's by the watch in :func:`_unless_disconnected`; either way the request is
aborted, counted, and its KV blocks return to the pool.
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
from starlette.exceptions import HTTPException

from lessonlib.engine.async_llm import AsyncLLM
from lessonlib.engine.chat import chat_prompts
from lessonlib.engine.requests import tokenize
from lessonlib.engine.serve.metrics import Metrics
from lessonlib.engine.serve.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                             chat_turns, completion_logprobs, field_named_in, refuse_unsupported,
                                             sampling_params)

DISCONNECT_POLL_S = 0.25  # how often a plain (non-streaming) request checks that its client is still there
MAX_BODY_BYTES = 4 * 2**20  # a longer body is refused (413) before it is parsed: no prompt that fits needs more
STATUS_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "RequestTooLarge",
                422: "UnprocessableEntity", 500: "InternalServerError"}


def build_app(engine: AsyncLLM, model_name: str, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await engine.shutdown()  # every running request aborted, the stepping task and its thread stopped

    app = FastAPI(title="lessonlib engine (OpenAI-compatible)", lifespan=lifespan)
    app.state.engine, app.state.model_name = engine, model_name
    app.state.metrics = Metrics(engine, model_name)
    app.add_middleware(_ArrivalAndBodyLimit, max_body_bytes=max_body_bytes)
    _error_handlers(app)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(app.state.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "lessonlib", "max_model_len": engine.llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(request, body, chat=True)

    return app


def _error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(ApiError(message, status, STATUS_TYPES.get(status, "invalid_request_error"), param,
                                 code).body(), status_code=status)


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's body: the client's (4xx) and the server's own (500)."""
    @app.exception_handler(ApiError)
    async def api_error(_request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        kind = first.get("type")
        message = "the body is not valid JSON" if kind == "json_invalid" else f"{where}: {first.get('msg')}"
        return _error_body(400, message, where)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):  # unknown route, wrong method, a body not UTF-8
        message = "the body is not valid UTF-8 JSON" if error.status_code == 400 else str(error.detail)
        return _error_body(error.status_code, message)

    @app.exception_handler(Exception)
    async def server_error(_request, error: Exception):
        return _error_body(500, f"internal error: {type(error).__name__}")


class _ArrivalAndBodyLimit:
    """ASGI middleware: stamps each request's arrival (TTFT counts from here, before parsing and tokenization) and
    answers 413 to a body longer than ``max_body_bytes`` (by its Content-Length, or as it streams in)."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrived"] = time.perf_counter()
        length = dict(scope.get("headers", ())).get(b"content-length", b"0")
        too_large = _error_body(413, f"the body is larger than {self.max_body_bytes} bytes")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            return await too_large(scope, receive, send)
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise _TooLarge
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _TooLarge:
            if not started:
                await too_large(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _serve(request: Request, body, chat: bool):
    """Check the request (off the event loop), then answer it streamed or whole."""
    state = request.app.state
    engine: AsyncLLM = state.engine
    arrived = request.scope.get("state", {}).get("arrived", time.perf_counter())
    if body.model != state.model_name:
        raise ApiError(f"The model {body.model!r} does not exist.", status=404, type="NotFoundError",
                       param="model", code="model_not_found")
    refuse_unsupported(body)
    prompt = chat_turns(body.messages) if chat else _completion_prompt(body.prompt)
    seqs, params, echo = await asyncio.to_thread(_checked, engine.llm, body, prompt, chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    answer = _Answer(request_id, state, chat, len(seqs[0]), arrived, params, echo)
    outputs = engine.stream(seqs, request_id)  # starts on its first iteration
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(answer.events(outputs, usage), media_type="text/event-stream")
    return JSONResponse(await _unless_disconnected(request, answer.whole(outputs)))


def _completion_prompt(prompt):
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError("one prompt per request is supported", param="prompt", code="not_supported")
        prompt = prompt[0]
    return prompt


def _checked(llm, body, prompt, chat: bool):
    """In a worker thread: the prompt rendered (chat) and tokenized, the parameters mapped, and the request's
    sequences made, each checked once, by the engine's own rules (``LLM.make_sequences``); the echo text
    (completions' ``echo``). ApiError (400) for anything refused."""
    where = "messages" if chat else "prompt"
    try:
        if chat:
            [rendered] = chat_prompts(llm.tokenizer, prompt, None, body.add_generation_prompt,
                                      llm.limits.max_prompt_chars)
            ids, text = rendered["prompt_token_ids"], rendered["prompt"]
        elif isinstance(prompt, str):
            ids, text = tokenize(llm.tokenizer, prompt, llm.limits.max_prompt_chars), prompt
        else:
            ids, text = prompt, None
        params = sampling_params(body, len(ids), llm.max_model_len)
        seqs = llm.make_sequences({"prompt_token_ids": ids, "prompt": text}, params)  # the prompt checked, once
    except (ValueError, TypeError) as error:
        message = str(error)
        if "maximum context" in message or "longer than the cache" in message:
            raise ApiError(message, param=where, code="context_length_exceeded") from None
        raise ApiError(message, param=field_named_in(message) or where) from None
    echo = None
    if body.echo:
        echo = text if text is not None else llm.tokenizer.decode(ids) if llm.tokenizer is not None else ""
    return seqs, params, echo


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
    index) or one response with its ``n`` choices; its metrics, counted once when it ends."""

    def __init__(self, request_id: str, state, chat: bool, prompt_tokens: int, arrived: float, params,
                 echo: str | None = None):
        self.id, self.model, self.chat = request_id, state.model_name, chat
        self.tokenizer = state.engine.llm.tokenizer
        self.metrics: Metrics = state.metrics
        self.prompt_tokens, self.arrived, self.created = prompt_tokens, arrived, int(time.time())
        self.top = params.logprobs  # None: no logprobs asked
        self.echo = echo
        self.choices = [_Choice() for _ in range(params.n)]
        self.first = self.last = None  # when its first and latest tokens were sent
        self.error: str | None = None  # why the engine ended it ("abort" with a reason), or the stream failed
        self.finished, self.counted = False, False
        self.queue_s, self.cached = None, 0
        self.metrics.prompt.inc(prompt_tokens)

    def _deltas(self, out) -> list[tuple[int, str, object, str | None]]:
        """Per choice with something new: (index, the text not sent yet, the new tokens' logprobs or None, its
        finish reason once it finished); records the new tokens' timing. The engine's text only grows (it holds
        back what a stop string could still cut), so the delta is what it adds to what was sent."""
        now, deltas = time.perf_counter(), []
        new = sum(len(c.token_ids) - self.choices[c.index].tokens for c in out.outputs)
        self.metrics.tokens(self.arrived, self.last, now, new)
        if new > 0:
            self.first, self.last = self.first or now, now
        self.queue_s, self.cached = out.queue_s, out.num_cached_tokens
        for completion in out.outputs:
            choice = self.choices[completion.index]
            ids = completion.token_ids[choice.tokens:]
            logprobs = None if self.top is None else self._logprobs(choice, ids, completion.logprobs[choice.tokens:])
            choice.tokens = len(completion.token_ids)
            text = completion.text or ""
            delta = text[len(choice.text):] if text.startswith(choice.text) else ""
            choice.text += delta
            if completion.finish_reason == "abort":
                self.error = self.error or completion.error or "the request was aborted"
            finish = completion.finish_reason if choice.finish is None else None  # named once
            choice.finish = choice.finish or completion.finish_reason
            if delta or ids or finish:
                deltas.append((completion.index, delta, logprobs, finish))
        self.finished = out.finished
        return deltas

    def _end(self) -> None:
        """Count the request once, as it ends: finished, aborted by the engine, or cut (its client went away)."""
        if self.counted:
            return
        self.counted = True
        reason = "abort" if self.error or not self.finished else self.choices[0].finish
        self.metrics.request(reason, time.perf_counter() - self.arrived,
                             None if self.first is None else self.first - self.arrived,
                             sum(c.tokens for c in self.choices), self.queue_s, self.prompt_tokens, self.cached)

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
        asked), [DONE]; an error event before [DONE] if the request did not end normally."""
        try:
            for index in range(len(self.choices)):
                if self.chat or self.echo:
                    yield _sse(self._chunk(index, self.echo, first=self.chat))
            async for out in outputs:
                for index, delta, logprobs, finish in self._deltas(out):
                    if finish != "abort":
                        yield _sse(self._chunk(index, delta, logprobs, finish))
        except Exception as error:  # the engine's step failed: this stream ends with the error, not cut
            self.error = f"the request failed: {type(error).__name__}: {error}"
        finally:  # a client that went away: its request is aborted as ``outputs`` closes
            await outputs.aclose()
            self._end()
        if self.error:
            yield _sse(ApiError(self.error, status=500, type="InternalServerError", code="aborted").body())
        elif usage:
            yield _sse({**self._chunk(None, None), "usage": self._usage()})
        yield "data: [DONE]\n\n"

    async def whole(self, outputs) -> dict:
        try:
            async for out in outputs:
                self._deltas(out)
        except Exception as error:
            self.error = f"the request failed: {type(error).__name__}: {error}"
        finally:
            await outputs.aclose()
            self._end()
        if self.error:
            raise ApiError(self.error, status=500, type="InternalServerError", code="aborted")
        choices = []
        for index, choice in enumerate(self.choices):
            logprobs = None if self.top is None else self._whole_logprobs(choice)
            text = (self.echo or "") + choice.text
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": choice.finish})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self._usage()}

    def _whole_logprobs(self, choice: _Choice) -> dict:
        if self.chat:
            return {"content": choice.logprobs}
        return {key: [x for piece in choice.logprobs for x in piece[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
