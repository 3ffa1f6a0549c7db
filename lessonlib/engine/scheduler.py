"""Continuous batching: which sequences run in the next step.

Each step is either a *prefill* step (admit waiting requests, compute their prompts) or a *decode* step (one new
token for every running sequence), as in nano-vllm. Admission happens at every step boundary, so a request that
arrives while others decode joins at the next step, and a finished sequence's blocks are free for the next one.

The admission rule (:meth:`Scheduler.can_admit`): a waiting request starts when there is room for one more
sequence in the batch, its new tokens fit the step's token budget, and the free blocks cover its prompt (minus the
blocks the prefix cache already holds). First come, first served: a request that does not fit blocks the queue.

When a decode step needs a block and none is free, the most recently admitted sequence is *preempted*: its blocks
are freed and it goes back to the front of the queue, to be recomputed (prompt and generated tokens as one new
prompt) when blocks free up. Nothing is ever half-allocated, and no block is written by two sequences out of order:
every step runs on one CUDA stream, so a step launched after a block changed hands runs after every earlier step
that wrote it (with scheduling ahead, a request that met a stop token may still be writing its last block when the
host frees it; only later steps can be given that block).

*Scheduling ahead* (:meth:`Scheduler.schedule_ahead`, the engine's ``async_scheduling``): the next decode step is
scheduled while the current one runs on the GPU, before its tokens reach the host. Each running sequence's last
token is then a placeholder whose position, not value, is known, which is all the block bookkeeping needs. It
declines (the engine then waits for the tokens and schedules as above) whenever the decision could depend on them:
a request might be admitted (now, or once a sequence that ends by length has left), or a sequence needs a block and
none is free.

*Chunked prefill* (``chunked=True``, the engine's ``chunked_prefill``; vLLM V1's default, Sarathi-Serve): a step
is no longer prefill or decode but one mixed batch under a token budget (``max_num_batched_tokens``). The running
decodes go first, one token each; the budget left goes to prompts in arrival order (:func:`prompt_chunks`), the one
in progress first, then waiting ones while a seat, the blocks of their whole prompt and some budget are free. A
prompt may so take several steps; its first token is sampled after its last chunk. A prompt's blocks are allocated
at admission, but a block joins the prefix cache only once the step that writes it is scheduled; a preempted prompt
starts over. Each scheduled sequence's token range is in :attr:`Scheduler.chunks`.

``continuous=False`` is *static batching*, the ladder's rung below continuous batching: waiting requests are admitted
only when no sequence is running, so a batch runs until its longest request ends and the seats of the finished ones
stay empty meanwhile.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from lessonlib.engine.block_manager import BlockManager
from lessonlib.engine.sequence import Sequence, Status


def can_admit(prompt_blocks: int, cached_idle_blocks: int, cached_busy_blocks: int, free_blocks: int,
              running: int, max_num_seqs: int, new_tokens: int, batched_tokens: int, max_batched_tokens: int) -> bool:
    """The admission rule, as a pure function (lesson 07's exercise). A prompt needing ``prompt_blocks`` blocks of
    which the prefix cache holds ``cached_busy_blocks`` in use by other sequences and ``cached_idle_blocks`` in the
    free list fits when the blocks it must take from the free list (the uncached ones and the idle cached ones) are
    free, the batch has a seat, and its ``new_tokens`` fit the step's token budget (a lone prompt always does)."""
    take = (prompt_blocks - cached_idle_blocks - cached_busy_blocks) + cached_idle_blocks  # uncached + idle cached
    fits_budget = batched_tokens == 0 or batched_tokens + new_tokens <= max_batched_tokens
    return running < max_num_seqs and fits_budget and take <= free_blocks


def prompt_chunks(num_decodes: int, prompt_tokens_left: list[int], max_num_batched_tokens: int) -> list[int]:
    """The token-budget split of a chunked-prefill step (lesson 07's exercise): each running decode takes one token
    first, then each prompt, in order, takes as many of its tokens left as the budget still holds (0 once spent)."""
    budget, chunks = max_num_batched_tokens - num_decodes, []
    for left in prompt_tokens_left:
        chunks.append(max(0, min(left, budget)))
        budget -= chunks[-1]
    return chunks


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 continuous: bool = True, chunked: bool = False):
        self.blocks = block_manager
        self.continuous = continuous  # False: static batching, admission only when no sequence runs
        self.chunked = chunked  # chunked prefill: mixed steps under the token budget
        self.prefilling: dict[int, int] = {}  # seq_id -> tokens scheduled so far, for a prompt not yet all scheduled
        self.chunks: dict[int, tuple[int, int]] = {}  # the last chunked step: seq_id -> token range [start, end)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def can_admit(self, seq: Sequence, seats_taken: int, batched_tokens: int) -> bool:
        cached, idle = self.blocks.prefix_hits(seq)
        return can_admit(self.blocks.blocks_for(len(seq)), idle, cached - idle, self.blocks.num_free,
                         seats_taken, self.max_num_seqs, len(seq) - cached * self.blocks.block_size,
                         batched_tokens, self.max_num_batched_tokens)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next step's sequences and whether it is a prefill step. Blocks are allocated here, before the
        step runs, so the step itself cannot run out. Chunked prefill: a step with a prompt chunk is a prefill
        step (the prefill path runs it, decodes as one-token chunks), one without is a decode step."""
        if self.chunked:
            return self._schedule_chunked()
        admitted, batched = [], 0
        may_admit = self.continuous or not self.running  # static batching: a new batch once the last one is done
        while self.waiting and may_admit and self.can_admit(self.waiting[0], len(self.running), batched):
            seq = self.waiting.popleft()
            self.blocks.allocate(seq)
            batched += len(seq) - seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        if admitted:
            return admitted, True

        scheduled = []
        while self.running:
            seq = self.running.popleft()
            while not self.blocks.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())  # the latest admitted gives way
                else:
                    self.preempt(seq)  # cannot happen while max_model_len fits the pool: checked at admission
                    break
            else:
                self.blocks.append(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled, False

    def _schedule_chunked(self) -> tuple[list[Sequence], bool]:
        decodes = [seq for seq in self.running if seq.seq_id not in self.prefilling]
        for seq in decodes:  # blocks for the decodes' tokens first; the latest admitted gives way
            while seq.status is Status.RUNNING and not self.blocks.can_append(seq):
                self.preempt(self.running.pop())
            if seq.status is Status.RUNNING:
                self.blocks.append(seq)
        self.chunks = {s.seq_id: (len(s) - 1, len(s)) for s in self.running if s.seq_id not in self.prefilling}
        prompts = [s for s in self.running if s.seq_id in self.prefilling]
        sizes = prompt_chunks(len(self.chunks), [len(s) - self.prefilling[s.seq_id] for s in prompts],
                              self.max_num_batched_tokens)
        budget = self.max_num_batched_tokens - len(self.chunks) - sum(sizes)
        may_admit = self.continuous or not self.running
        while (budget and self.waiting and may_admit and len(self.running) < self.max_num_seqs
               and self.blocks.can_allocate(self.waiting[0])):
            seq = self.waiting.popleft()
            self.blocks.allocate(seq, register=False)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.prefilling[seq.seq_id] = seq.num_cached_tokens
            prompts.append(seq)
            sizes += prompt_chunks(0, [len(seq) - seq.num_cached_tokens], budget)
            budget -= sizes[-1]
        for seq, size in zip(prompts, sizes):
            start = self.prefilling[seq.seq_id]
            if size:
                self.chunks[seq.seq_id] = (start, start + size)
                for position in range(start, start + size):  # written by this step, before any later step reads
                    self.blocks.register_written(seq, position)
            if start + size == len(seq):
                del self.prefilling[seq.seq_id]  # its last chunk: the step samples its first token
            else:
                self.prefilling[seq.seq_id] = start + size
        seqs = [seq for seq in self.running if seq.seq_id in self.chunks]
        return seqs, any(end - start > 1 or start < len(seq) - 1 for seq in seqs
                         for start, end in [self.chunks[seq.seq_id]])

    def schedule_ahead(self, ends: Callable[[Sequence], bool]) -> list[Sequence]:
        """The next decode step, scheduled while the current step runs: every running sequence except those
        ``ends`` says its pending token finishes (by length; a stop token is only seen when the token arrives, so
        such a sequence runs one step too many and its extra token is dropped). Empty when the tokens must come
        first: the head of the queue could be admitted now, or a sequence ends by length (its seat and blocks free
        up, and the synchronous engine would admit at the next step), or the blocks the step needs are not free."""
        if self.prefilling:
            return []  # a prompt in progress: its next chunk needs a mixed step, scheduled with the tokens known
        batch = [seq for seq in self.running if not ends(seq)]
        if self.waiting and self.continuous and (len(batch) < len(self.running)
                                                 or self.can_admit(self.waiting[0], len(self.running), 0)):
            return []  # (static batching admits only once nothing runs: then the batch is empty, below)
        if not batch or sum(self.blocks.needs_block(seq) for seq in batch) > self.blocks.num_free:
            return []
        for seq in batch:
            self.blocks.append(seq)
        return batch

    def preempt(self, seq: Sequence) -> None:
        self.prefilling.pop(seq.seq_id, None)  # a prompt in progress starts over
        self.blocks.free(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop one request, waiting or running: its blocks go back to the pool now."""
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"

    def abort_running(self) -> None:
        """After a failed step: free every running sequence (their K/V may be half written, so the prefix cache is
        forgotten too). The waiting ones were not in the step and hold no blocks: they stay queued."""
        for seq in self.running:
            self.blocks.free(seq)
            seq.status = Status.FINISHED
            seq.finish_reason = "abort"
        self.running.clear()
        self.prefilling.clear()
        self.blocks.forget_prefix_cache()


def token_budget(max_num_batched_tokens: int | None, features: "Features", max_num_seqs: int,
                  max_model_len: int) -> int:
    """The step's token budget. Prefill-first by default fits any prompt (a lone prompt always runs); chunked
    prefill by default takes vLLM's online serving budget, 2048. Chunked, the budget must hold a token for every
    seat: the decodes go first, and a prompt in progress must still get one."""
    if max_num_batched_tokens is not None and (not isinstance(max_num_batched_tokens, int)
                                               or isinstance(max_num_batched_tokens, bool) or max_num_batched_tokens < 1):
        raise ValueError(f"max_num_batched_tokens must be an int >= 1, got {max_num_batched_tokens!r}")
    if not features.chunked_prefill:
        return max_num_batched_tokens or max(max_model_len, 2048)
    budget = max_num_batched_tokens or max(2048, max_num_seqs)
    if budget < max_num_seqs:
        raise ValueError(f"with chunked_prefill, max_num_batched_tokens ({budget}) must be at least max_num_seqs "
                         f"({max_num_seqs}): every running decode takes one token of each step's budget")
    return budget
