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


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 continuous: bool = True):
        self.blocks = block_manager
        self.continuous = continuous  # False: static batching, admission only when no sequence runs
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
        hits, _ = self.blocks._cached_prefix(seq)
        idle = sum(self.blocks.allocator.ref_counts[b] == 0 for b in hits)
        return can_admit(self.blocks.blocks_for(len(seq)), idle, len(hits) - idle, self.blocks.num_free,
                         seats_taken, self.max_num_seqs, len(seq) - len(hits) * self.blocks.block_size,
                         batched_tokens, self.max_num_batched_tokens)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next step's sequences and whether it is a prefill step. Blocks are allocated here, before the
        step runs, so the step itself cannot run out."""
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

    def schedule_ahead(self, ends: Callable[[Sequence], bool]) -> list[Sequence]:
        """The next decode step, scheduled while the current step runs: every running sequence except those
        ``ends`` says its pending token finishes (by length; a stop token is only seen when the token arrives, so
        such a sequence runs one step too many and its extra token is dropped). Empty when the tokens must come
        first: the head of the queue could be admitted now, or a sequence ends by length (its seat and blocks free
        up, and the synchronous engine would admit at the next step), or the blocks the step needs are not free."""
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

    def abort_all(self) -> None:
        """Free every sequence (after a failed step): the engine is empty and usable again."""
        for seq in [*self.running, *self.waiting]:
            self.blocks.free(seq)
            seq.status = Status.FINISHED
            seq.finish_reason = "abort"
        self.running.clear()
        self.waiting.clear()
        self.blocks.forget_prefix_cache()
