"""``AsyncLLM``: the engine behind an asyncio front, one stream of outputs per request (vLLM's ``AsyncLLM``).

    engine = AsyncLLM(LLM(model=path))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="a"):
        out.outputs[0].text, out.finished         # cumulative, as vLLM's default RequestOutputKind
    await engine.abort("a")                       # or just stop iterating: the request is aborted

One background task steps the engine; ``LLM.step`` runs in a worker thread, so the event loop (an HTTP server's)
keeps answering while the model computes. The engine's state is changed only between steps and only from the event
loop: a request added or aborted while a step runs is applied as soon as that step returns, one added or aborted while
the engine is idle at once. After each step every request with new tokens gets a ``RequestOutput`` on its own queue.

An aborted request (``abort``, or a consumer that stops iterating: a client that disconnects) leaves the scheduler
and returns its KV blocks to the pool before the next step runs (``LLM.abort_request``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lessonlib.engine.llm import LLM, PENDING
from lessonlib.engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence, Status


@dataclass
class _Stream:
    prompt: object
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None  # set once the engine has the request
    sent: int = 0  # output tokens already put on the queue


class AsyncLLM:
    def __init__(self, llm: LLM):
        if not isinstance(llm, LLM):
            raise TypeError(f"AsyncLLM wraps a lessonlib.engine.LLM, got {type(llm).__name__}")
        self.llm = llm
        self._streams: dict[str, _Stream] = {}
        self._to_add: list[str] = []
        self._to_abort: list[str] = []
        self._stepping = False  # a step runs in the worker thread: the engine's state must not change now
        self._closed = False
        self.num_aborted = 0  # requests stopped before they finished (abort, or a consumer that went away)
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")

    # --- requests ----------------------------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after each step that gave it tokens, the last with ``finished`` True. A bad
        prompt or params raise here, before the engine sees the request."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if self._closed:
            raise RuntimeError("this AsyncLLM has been shut down")
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already running")
        self.llm.make_sequence(prompt, params)  # the checks alone: raises before anything is queued
        stream = self._streams[request_id] = _Stream(prompt, params)
        self._to_add.append(request_id)
        self._kick()
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:  # the consumer stopped early (a client disconnected), or the step failed
                self._abort_now_or_after_step(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request: its KV blocks go back to the pool now, or when the step running now returns."""
        self._abort_now_or_after_step(request_id)

    def _abort_now_or_after_step(self, request_id: str) -> None:
        if request_id in self._streams:
            self._to_abort.append(request_id)
            if not self._stepping:
                self._apply_pending()

    # --- the stepping task -------------------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    def _apply_pending(self) -> None:
        """Aborts, then additions, applied to the engine (called only while no step runs)."""
        for request_id in self._to_abort:
            stream = self._streams.pop(request_id, None)
            if stream is not None and stream.seq is not None:
                self.num_aborted += self.llm.abort_request(stream.seq)
                # its last output, for a consumer still listening (an abort() from elsewhere)
                stream.queue.put_nowait(self._output(request_id, stream.seq, stream.seq.output_token_ids, True))
            elif stream is not None:
                stream.queue.put_nowait(RuntimeError(f"request {request_id!r} was aborted before it started"))
        self._to_abort.clear()
        for request_id in self._to_add:
            stream = self._streams.get(request_id)
            if stream is None:  # aborted before it started
                continue
            try:
                stream.seq = self.llm.add_request(stream.prompt, stream.params)
            except Exception as error:  # checked in generate(); the engine's own refusal still reaches the caller
                self._streams.pop(request_id)
                stream.queue.put_nowait(error)
        self._to_add.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            self._apply_pending()
            if not self.llm.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            self._stepping = True
            try:
                await loop.run_in_executor(self._worker, self.llm.step)
            except Exception as error:  # the engine freed every request (LLM.step): each stream gets the error
                for stream in self._streams.values():
                    stream.queue.put_nowait(error)
                self._streams.clear()
                self._to_add.clear()
                continue
            finally:
                self._stepping = False
                del self.llm.steps[:]  # a server runs for days: the step records are the offline lesson's
            self._publish()
        self._apply_pending()  # shutdown's aborts

    def _publish(self) -> None:
        for request_id, stream in list(self._streams.items()):
            seq = stream.seq
            if seq is None:
                continue
            known = seq.output_token_ids
            if PENDING in known:
                known = known[:known.index(PENDING)]
            done = seq.status is Status.FINISHED
            if len(known) > stream.sent or done:
                stream.sent = len(known)
                stream.queue.put_nowait(self._output(request_id, seq, known, done))
            if done:
                del self._streams[request_id]

    def _output(self, request_id: str, seq: Sequence, ids: list[int], done: bool) -> RequestOutput:
        tokenizer = self.llm.tokenizer
        text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
        completion = CompletionOutput(0, text, list(ids), seq.finish_reason if done else None)
        return RequestOutput(request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], [completion],
                             num_cached_tokens=seq.num_prompt_cached_tokens, num_preemptions=seq.num_preemptions,
                             finished=done)

    # --- state, for the server's metrics -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.llm.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.llm.scheduler.waiting) + len(self._to_add)

    async def shutdown(self) -> None:
        """Abort every request (after the step running now, if any) and stop the stepping task and its thread."""
        self._closed = True
        self._to_abort.extend(self._streams)
        if self._loop_task is not None and not self._loop_task.done():
            self._wake.set()
            await self._loop_task
        else:
            self._apply_pending()
        self._worker.shutdown(wait=True)
