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
and returns its KV blocks to the pool before the next step runs (``LLM.abort_request``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from lessonlib.engine.llm import LLM, PENDING
from lessonlib.engine.outputs import completion
from lessonlib.engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence, Status


@dataclass
class _Stream:
    prompt: object
    params: SamplingParams
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seqs: list[Sequence] = field(default_factory=list)  # the n samples, set once the engine has the request
    sent: list[int] = field(default_factory=list)  # each sample's output tokens already put on the queue


def _sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of a request's ``n`` samples: one sequence, seeded ``seed + i`` (``LLM.generate``'s rule)."""
    seed = params.seed if params.seed is None or i == 0 else (params.seed + i) % 2**64
    return replace(params, n=1, seed=seed)


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
            if stream is not None and stream.seqs:
                self.num_aborted += any([self.llm.abort_request(seq) for seq in stream.seqs])
                # its last output, for a consumer still listening (an abort() from elsewhere)
                known = [seq.output_token_ids for seq in stream.seqs]
                stream.queue.put_nowait(self._output(request_id, stream.seqs, known))
            elif stream is not None:
                stream.queue.put_nowait(RuntimeError(f"request {request_id!r} was aborted before it started"))
        self._to_abort.clear()
        for request_id in self._to_add:
            stream = self._streams.get(request_id)
            if stream is None:  # aborted before it started
                continue
            try:
                for i in range(stream.params.n):
                    stream.seqs.append(self.llm.add_request(stream.prompt, _sample_params(stream.params, i)))
                    stream.sent.append(0)
            except Exception as error:  # checked in generate(); the engine's own refusal still reaches the caller
                for seq in stream.seqs:
                    self.llm.abort_request(seq)
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
            if not stream.seqs:
                continue
            known = [seq.output_token_ids for seq in stream.seqs]
            known = [ids[:ids.index(PENDING)] if PENDING in ids else ids for ids in known]
            done = all(seq.status is Status.FINISHED for seq in stream.seqs)
            if done or any(len(ids) > sent for ids, sent in zip(known, stream.sent)):
                stream.sent = [len(ids) for ids in known]
                stream.queue.put_nowait(self._output(request_id, stream.seqs, known))
            if done:
                del self._streams[request_id]

    def _output(self, request_id: str, seqs: list[Sequence], known: list[list[int]]) -> RequestOutput:
        """The request's output so far: ``known[i]`` the tokens of sample i that reached the host. A finished sample
        is given as ``LLM.generate`` gives it (its text cut at a stop string, its logprobs' tokens decoded)."""
        tokenizer, first = self.llm.tokenizer, seqs[0]
        completions = []
        for i, (seq, ids) in enumerate(zip(seqs, known)):
            if seq.status is Status.FINISHED:
                completions.append(completion(tokenizer, seq, i))
                continue
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
            logprobs = seq.logprobs[:len(ids)] if seq.logprobs is not None else None
            completions.append(CompletionOutput(i, text, list(ids), None, logprobs=logprobs))
        return RequestOutput(request_id, first.prompt, first.token_ids[:first.num_prompt_tokens], completions,
                             num_cached_tokens=first.num_prompt_cached_tokens,
                             num_preemptions=sum(seq.num_preemptions for seq in seqs),
                             finished=all(seq.status is Status.FINISHED for seq in seqs))

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
