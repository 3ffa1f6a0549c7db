"""Lesson 03's checkers (notebook 03_paged_attention), the block table: a token's physical slot, freeing a
sequence's blocks, and the paged decode kernel's block-table walk the student writes (kernel exercise 2).
"""

from __future__ import annotations

import torch

from lessonlib import reference, runtime
from lessonlib.exercises._checking import (ExerciseFailed, _call, _diagnose, _inputs, _not_implemented_output,
                                           _require_kernel, passed)
from lessonlib.exercises._guards import Guards, launch_guards, launch_kernel, output_like
from lessonlib.testing import attention_allowance, to_float64


def check_physical_slot(fn) -> None:
    """``fn(position, block_table, block_size) -> (physical_block, offset)``: where the K/V of token ``position``
    of a sequence lives, given its block table (a list of physical block ids, logical order)."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    cases = [(0, [17, 4, 29, 8], 16), (15, [17, 4, 29, 8], 16), (16, [17, 4, 29, 8], 16), (63, [17, 4, 29, 8], 16)]
    for _ in range(40):
        block_size = int(2 ** torch.randint(0, 7, (), generator=generator))
        table = torch.randperm(200, generator=generator)[: int(torch.randint(1, 12, (), generator=generator))].tolist()
        cases.append((int(torch.randint(0, len(table) * block_size, (), generator=generator)), table, block_size))
    for position, table, block_size in cases:
        want = (table[position // block_size], position % block_size)
        try:
            got = fn(position, list(table), block_size)
        except NotImplementedError as e:
            raise ExerciseFailed(f"physical_slot: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        if tuple(got) != want:
            raise ExerciseFailed(f"physical_slot({position}, {table}, block_size={block_size}) = {tuple(got)}, expected "
                                 f"{want}: logical block = position // block_size, then look it up in the table")
    passed(f"physical_slot: correct on {len(cases)} positions, including the lesson's example table 17 4 29 8")


def check_free_sequence(fn) -> None:
    """``fn(table, ref_counts, free_blocks) -> None``: free one sequence whose blocks are ``table``. Each block's
    reference count drops by one; a block whose count reaches 0 is appended to ``free_blocks`` (in table order).
    A block whose count is already 0 must raise ValueError (a double free) and leave everything unchanged."""
    from lessonlib.kv_cache import BlockAllocator

    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for trial in range(20):
        num_blocks = 16
        allocator = BlockAllocator(num_blocks)
        tables = {}
        for seq in range(4):  # sequences, some sharing a prefix of blocks with the previous one
            shared = tables[seq - 1][: int(torch.randint(0, 3, (), generator=generator))] if seq else []
            for block in shared:
                allocator.share(block)
            tables[seq] = shared + [allocator.allocate() for _ in range(int(torch.randint(1, 3, (), generator=generator)))]
        victim = int(torch.randint(0, 4, (), generator=generator))
        counts, free_blocks = list(allocator.ref_counts), []
        try:
            result = fn(list(tables[victim]), counts, free_blocks)
        except NotImplementedError as e:
            raise ExerciseFailed(f"free_sequence: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        want_counts = list(allocator.ref_counts)
        want_free = []
        for block in tables[victim]:
            want_counts[block] -= 1
            if want_counts[block] == 0:
                want_free.append(block)
        if counts != want_counts:
            raise ExerciseFailed(f"free_sequence: reference counts {counts}, expected {want_counts} after freeing "
                                 f"{tables[victim]} (shared blocks drop by one and stay in use)")
        if free_blocks != want_free:
            raise ExerciseFailed(f"free_sequence: returned {free_blocks} to the pool, expected {want_free}: only "
                                 "blocks whose count reaches 0")
        if result is not None:
            raise ExerciseFailed("free_sequence: update ref_counts and free_blocks in place and return None")
        # Freeing the same sequence again: its unshared blocks are at 0 now: a double free.
        before = (list(counts), list(free_blocks))
        if want_free:
            try:
                fn(list(tables[victim]), counts, free_blocks)
            except ValueError:
                if (counts, free_blocks) != before:
                    raise ExerciseFailed("free_sequence: the double free raised, but only after changing the counts; "
                                         "check every block first, then change anything") from None
            else:
                raise ExerciseFailed(f"free_sequence: freeing {tables[victim]} twice did not raise ValueError")
    passed("free_sequence: correct on 20 pools with shared prefixes, double frees refused with nothing changed")


# --- 2. The paged attention kernel's block-table walk (notebook 03) ----------------------------------------------


def paged_decode(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, guards: Guards | None = None) -> torch.Tensor:
    """Launch the exercise's decode kernel: one program per (sequence, query head). Inputs as
    ``lessonlib.reference.paged_attention``: q (B, H, D); caches (num_blocks, block_size, Hkv, D) contiguous with
    block_size and D powers of two (tl.arange needs them); block_table (B, max_blocks) int32; seq_lens (B,) int32,
    each at least 1. Validated as lessonlib's kernel validates them, tables included. Returns (B, H, D).
    ``guards``: the checker's (:mod:`~lessonlib.exercises._guards`)."""
    from lessonlib.ops.paged_attention import check_inputs

    check_inputs(q, k_cache, v_cache, block_table, seq_lens)  # shapes, dtypes, devices, and the tables' range
    q = q.contiguous()
    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    with launch_guards("paged_decode", guards) as guards:
        out = output_like(guards, "out", q)
        launch_kernel(guards, "paged_decode", kernel, (batch, heads), q, k_cache, v_cache, block_table.contiguous(), seq_lens, out,
               block_table.shape[1], kv_heads, num_blocks * block_size * kv_heads, head_dim ** -0.5,
               GROUP=heads // kv_heads, PAGE_SIZE=block_size, HEAD_DIM=head_dim, num_warps=4)
    return out


def _paged_decode_with_rows(q, k_cache, v_cache, seq_lens, rows_of):
    """float64 decode attention where token t of sequence b, query head h, reads cache row ``rows_of(b, h, t)`` of
    the cache seen as (num_blocks * block_size * Hkv, D); a row outside the pool is skipped, as the kernel's
    guarded load skips it."""
    flat_k = k_cache.reshape(-1, k_cache.shape[-1])
    flat_v = v_cache.reshape(-1, v_cache.shape[-1])
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        for h in range(q.shape[1]):
            rows = torch.tensor([rows_of(b, h, t) for t in range(n)], dtype=torch.int64)
            inside = (rows >= 0) & (rows < flat_k.shape[0])
            if inside.any():
                rows = rows[inside]
                p = torch.softmax(flat_k[rows] @ q[b, h] * q.shape[-1] ** -0.5, dim=0)
                out[b, h] = p @ flat_v[rows]
    return out


def _paged_decode_mistakes(q, k_cache, v_cache, table, seq_lens):
    _, block_size, kv_heads, _ = k_cache.shape
    group = q.shape[1] // kv_heads

    def rows(physical, head_of):
        return lambda b, h, t: (physical(b, t // block_size) * block_size + t % block_size) * kv_heads + head_of(h)

    def run(rows_of):
        return _paged_decode_with_rows(q, k_cache, v_cache, seq_lens, rows_of)

    def right(b, i):
        return int(table[b, i])

    yield ("a walk that uses the logical block index as the physical one gives: the table maps logical block i of "
           "sequence b to its physical block: physical = block_table[b, i], loaded from the table",
           run(rows(lambda b, i: i, lambda h: h // group)))
    yield ("reading sequence 0's row of the block table for every sequence gives: sequence b's row starts at "
           "block_table_ptr + b * max_blocks", run(rows(lambda b, i: int(table[0, i]), lambda h: h // group)))
    yield ("every query head reading KV head 0 gives: add kv_head (= head // GROUP) to the row",
           run(rows(right, lambda h: 0)))
    if group > 1:
        yield ("indexing the cache with the query head instead of its KV head gives: kv_head = head // GROUP",
               run(rows(right, lambda h: h)))
    yield ("a cache laid out as (num_blocks, Hkv, block_size, D) gives: the pool is (num_blocks, block_size, Hkv, "
           "D), so a token's rows for all heads are adjacent: row = (physical * PAGE_SIZE + t) * Hkv + kv_head",
           run(lambda b, h, t: (right(b, t // block_size) * kv_heads + h // group) * block_size + t % block_size))
    yield ("rows without the block size (physical + offset, not physical * PAGE_SIZE + offset) give: a physical "
           "block holds PAGE_SIZE tokens",
           run(lambda b, h, t: (right(b, t // block_size) + t % block_size) * kv_heads + h // group))


PAGED_DECODE_CASES = (  # (batch, heads, kv_heads, head_dim, block_size, seq_lens); block sizes as lessonlib's kernel
    (1, 1, 1, 16, 16, (1,)),
    (3, 4, 2, 16, 16, (45, 17, 1)),  # lengths not multiples of the block size
    (2, 8, 2, 32, 16, (33, 100)),
    (2, 2, 1, 16, 32, (70, 5)),
)


def _paged_inputs(batch, heads, kv_heads, head_dim, block_size, lengths, dtype):
    """A pool with 3 spare blocks, each sequence's blocks drawn from it in random order (a walk that skips the
    table reads other blocks)."""
    device = runtime.device()
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks)
    max_blocks = max(blocks) + 1  # one unused column: a walk past the last block must not matter
    table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = order[used:used + n].to(torch.int32)
        used += n
    k_cache, v_cache = _inputs(*[(num_blocks, block_size, kv_heads, head_dim)] * 2, dtype=dtype)
    (q,) = _inputs((batch, heads, head_dim), dtype=dtype)
    return q, k_cache, v_cache, table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


def check_paged_decode_kernel(kernel) -> None:
    """``kernel``: the exercise's decode kernel (its block-table walk written by the student), launched by
    :func:`paged_decode`. Checked against ``reference.paged_attention`` in float64 on shuffled tables, GQA, block
    sizes 16 and 32, lengths 1 to 100 (not multiples of the block size), in every supported dtype, every tensor in
    guard zones (a missing mask is named)."""
    _require_kernel("paged_decode", kernel, "my_paged_decode_kernel")
    for dtype in runtime.supported_dtypes():
        for batch, heads, kv_heads, head_dim, block_size, lengths in PAGED_DECODE_CASES:
            guards = Guards("paged_decode")
            args = tuple(guards.place(name, t) for name, t in zip(("q", "k_cache", "v_cache", "block_table", "seq_lens"),
                         _paged_inputs(batch, heads, kv_heads, head_dim, block_size, lengths, dtype)))
            q, k_cache, v_cache, table, seq_lens = args
            where = (f"{batch} sequences of {list(lengths)} tokens, {heads} query heads over {kv_heads} KV heads, "
                     f"block_size {block_size}, {str(dtype).removeprefix('torch.')}, block table {table.tolist()}")
            out = guards.run(lambda: _call("paged_decode", lambda *a: paged_decode(kernel, *a, guards=guards), args))
            with guards.judged():
                truth = reference.paged_attention(*to_float64(q, k_cache, v_cache), table, seq_lens)
                if out.isnan().all():
                    raise ExerciseFailed("paged_decode: not implemented yet: the kernel stored nothing. Fill in the walk.")
                _not_implemented_output("paged_decode", out, truth)
                cpu64 = [t.cpu() for t in to_float64(q, k_cache, v_cache)]
                _diagnose("paged_decode", out, truth, reference.paged_attention(*args),
                          lambda: _paged_decode_mistakes(*cpu64, table.cpu(), seq_lens.cpu()), where,
                          attention_allowance(q, k_cache, v_cache))
    passed(f"paged_decode: your block-table walk reads the right K/V rows on {len(PAGED_DECODE_CASES)} pools (shuffled "
          "tables, GQA, block sizes 16 and 32, lengths 1-100), within tolerance of float64")
