"""``AsyncLLM``: the engine behind an asyncio front, one stream of outputs per request (vLLM's ``AsyncLLM``).

    engine = AsyncLLM(LLM(model=path))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="a"):
        out.outputs[0].text, out.finished         # cumulative, as vLLM's default RequestOutputKind
    await engine.abort("a")                       # or just stop iterating: the request is aborted

``SamplingParams.n`` > 1 runs the prompt's ``n`` samples as ``n`` sequences (seeds ``seed + i``, as
``LLM.generate``), one ``RequestOutput`` with ``n`` completions; a completion's ``logprobs`` are those of its tokens
so far (their ``decoded_token`` filled in once it finishes).

One background task steps the engine; ``LLM.step`` runs in a worker thread, so the event loop (an HTTP server's)
keeps answering while the model computes. The engine's state is changed only between steps and only from the event
loop: a request added or aborted while a step runs is applied as soon as that step returns, one added or aborted while
the engine is idle at once. After each step every request with new tokens gets a ``RequestOutput`` on its own queue.

An aborted request (``abort``, or a consumer that stops iterating: a client that disconnects) leaves the scheduler
and returns its KV blocks to the pool before the next step runs (``LLM.abort_request``). A request whose own
sampling fails ends alone (``finish_reason`` "abort", its ``error`` saying why); only a step that fails as a whole
(the batched model itself) ends the requests running, each of their streams getting the error; the waiting ones
run on.

A server checks (and tokenizes) a request off the event loop first, ``LLM.make_sequences`` in a thread, then
streams the checked sequences with ``stream(seqs, request_id)``; ``generate`` does both in one call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lessonlib.engine.llm import LLM, PENDING
from lessonlib.engine.outputs import request_output
from lessonlib.engine.sequence import RequestOutput, SamplingParams, Sequence, Status


@dataclass
class _Stream:
    seqs: list[Sequence]  # the n samples, checked; queued in the engine once added
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: list[int] = field(default_factory=list)  # each sample's output tokens already put on the queue
    added: bool = False


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
        self.num_aborted = 0  # requests stopped before they finished (abort, a consumer that went away, a failure)
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")

    # --- requests ----------------------------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after each step that gave it tokens, the last with ``finished`` True. A bad
        prompt or params raise here, before the engine sees the request."""
        outputs = self.stream(self.llm.make_sequences(prompt, params), request_id)
        try:
            async for out in outputs:
                yield out
        finally:  # a consumer that stops early aborts the request now, not when the inner generator is collected
            await outputs.aclose()

    async def stream(self, seqs: list[Sequence], request_id: str) -> AsyncIterator[RequestOutput]:
        """``generate`` for a request already checked: its sequences from ``LLM.make_sequences``."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {request_id!r}")
        if self._closed:
            raise RuntimeError("this AsyncLLM has been shut down")
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already running")
        stream = self._streams[request_id] = _Stream(list(seqs), sent=[0] * len(seqs))
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
            if stream is not None and stream.added:
                self.num_aborted += any([self.llm.abort_request(seq) for seq in stream.seqs])
                # its last output, for a consumer still listening (an abort() from elsewhere)
                stream.queue.put_nowait(request_output(self.llm.tokenizer, stream.seqs, request_id))
            elif stream is not None:
                self.num_aborted += 1
                stream.queue.put_nowait(RuntimeError(f"request {request_id!r} was aborted before it started"))
        self._to_abort.clear()
        for request_id in self._to_add:
            stream = self._streams.get(request_id)
            if stream is not None:  # (None: aborted before it started)
                self.llm.add_sequences(stream.seqs)
                stream.added = True
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
            except Exception as error:  # the batched step failed as a whole (LLM.step freed what it held)
                self._fail_stepped(error)
                continue
            finally:
                self._stepping = False
                del self.llm.steps[:]  # a server runs for days: the step records are the offline lesson's
            self._publish()
        self._apply_pending()  # shutdown's aborts

    def _fail_stepped(self, error: Exception) -> None:
        """After a step that failed as a whole: the requests it ended (the running ones) get the error; a waiting
        request, or one not yet added, runs on."""
        for request_id, stream in list(self._streams.items()):
            if stream.added and all(seq.status is Status.FINISHED for seq in stream.seqs):
                self.num_aborted += 1
                stream.queue.put_nowait(error)
                del self._streams[request_id]

    def _publish(self) -> None:
        for request_id, stream in list(self._streams.items()):
            if not stream.added:
                continue
            known = [seq.output_token_ids for seq in stream.seqs]
            known = [ids[:ids.index(PENDING)] if PENDING in ids else ids for ids in known]
            done = all(seq.status is Status.FINISHED for seq in stream.seqs)
            if done or any(len(ids) > sent for ids, sent in zip(known, stream.sent)):
                stream.sent = [len(ids) for ids in known]
                out = request_output(self.llm.tokenizer, stream.seqs, request_id, known)
                self.num_aborted += done and any(c.finish_reason == "abort" for c in out.outputs)
                stream.queue.put_nowait(out)
            if done:
                del self._streams[request_id]

    # --- state, for the server's metrics: requests (a request's n samples count once) ---------------------------
    @property
    def num_running(self) -> int:
        return sum(stream.added and any(seq.status is Status.RUNNING for seq in stream.seqs)
                   for stream in self._streams.values())

    @property
    def num_waiting(self) -> int:
        return len(self._streams) - self.num_running

    def abort_all(self, reason: str | None = None) -> None:
        """Abort every request (after the step running now, if any); each stream gets its last output, "abort",
        with ``reason`` as its error."""
        for request_id, stream in list(self._streams.items()):
            for seq in stream.seqs:
                seq.error = seq.error or reason
            self._abort_now_or_after_step(request_id)

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
