"""``LLM(check_kernels=True)``: before each step's kernels launch, the block tables and lengths the scheduler
produced are checked on the host, so a scheduler bug (a student's, while changing it) raises a ValueError naming
the sequence instead of reading another sequence's K/V, writing outside the pool, or crashing the device. The
kernels themselves read the tables unchecked (``validate=False``: a check costs a device sync per launch)."""

from __future__ import annotations

from collections import Counter

from lessonlib.engine.block_manager import BlockManager
from lessonlib.engine.sequence import Sequence


def check_step(seqs: list[Sequence], running: list[Sequence], manager: BlockManager, is_prefill: bool) -> None:
    """The step's sequences ``seqs`` among the ``running`` ones: each block id inside the pool and held (reference
    count >= the running tables that hold it), no block twice in one table, every token's slot inside the
    sequence's blocks, and a prefill's cached prefix shorter than its sequence."""
    pool, held = manager.num_blocks, Counter(b for seq in running for b in seq.block_table)
    for seq in seqs:
        table, name = seq.block_table, f"check_kernels: sequence {seq.seq_id}"
        outside = [b for b in table if not (isinstance(b, int) and 0 <= b < pool)]
        if outside:
            raise ValueError(f"{name}'s block table holds block {outside[0]!r}, outside the pool of {pool} blocks")
        if len(set(table)) != len(table):
            raise ValueError(f"{name}'s block table holds a block twice: {table}")
        if manager.blocks_for(len(seq)) > len(table):
            raise ValueError(f"{name} has {len(seq)} tokens but {len(table)} blocks of {manager.block_size}: a "
                             "token's slot would fall outside its blocks")
        over = [b for b in table if held[b] > manager.allocator.ref_counts[b]]
        if over:
            raise ValueError(f"{name}: block {over[0]} is in {held[over[0]]} running block tables but its reference "
                             f"count is {manager.allocator.ref_counts[over[0]]} (freed, or given out twice)")
        if is_prefill and not 0 <= seq.num_cached_tokens < len(seq):
            raise ValueError(f"{name}: {seq.num_cached_tokens} cached tokens of {len(seq)}: a prefill must compute "
                             "at least the last token")
