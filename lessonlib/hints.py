"""Hints for the kernel exercises, revealed one at a time on request, never shown by default:

    >>> from lessonlib.hints import hint
    >>> hint("flash_forward", 1)    # the first hint; 2, 3 ... say more, the last is nearly the answer

Each list goes from a nudge to the shape of the answer. They name the ideas, not the code.
"""

from __future__ import annotations

HINTS: dict[str, list[str]] = {
    "flash_forward": [
        "The loop is lesson 02's online-softmax update (exercise 1), on tiles: for each tile of BLOCK_N keys, load "
        "K and V for rows start_n + offs_n, compute the (BLOCK_M, BLOCK_N) scores with tl.dot, fold them into "
        "m_i, l_i and acc.",
        "Masks: a key column at or past n_kv gets score -inf (it does not exist); with CAUSAL, so does key j for "
        "query i when j > i + (n_kv - n_q). tl.where(visible, s, float('-inf')) after the dot. Loads of rows past "
        "n_kv need mask=... and other=0.0.",
        "The update, with alpha = tl.exp(m_i - m_new): l_i = l_i * alpha + tl.sum(p, 1) and "
        "acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), where p = tl.exp(s - m_new[:, None]).",
        "The causal bound: the tile's last real query row is min(start_m + BLOCK_M, n_q) - 1; it sees keys up to "
        "that + (n_kv - n_q). So loop start_n over range(0, hi, BLOCK_N) with "
        "hi = min(n_kv, min(start_m + BLOCK_M, n_q) + n_kv - n_q) (tl.minimum). Past hi every key is masked "
        "for every row of the tile: skipping those tiles is FlashAttention's causal saving.",
    ],
    "paged_decode": [
        "Two look-ups: the table tells which physical block holds logical block `logical` of sequence `seq`; the "
        "pool's layout tells where token t of that block keeps its row for kv_head.",
        "The table is (B, max_blocks), contiguous: sequence seq's row starts at block_table_ptr + seq * max_blocks. "
        "tl.load it (one int32) and widen it with .to(tl.int64) before multiplying: pools get large.",
        "The cache is (num_blocks, PAGE_SIZE, Hkv, D). Seen as rows of D values, token t of physical block p, "
        "head kv_head, is row (p * PAGE_SIZE + t) * Hkv + kv_head. offs_t gives all the block's t at once.",
    ],
    "rope": [
        "Per token and head: out[:HALF] = x1 * cos[:HALF] - x2 * sin[:HALF] and out[HALF:] = x2 * cos[HALF:] + "
        "x1 * sin[HALF:], where x1 = x[:HALF], x2 = x[HALF:] (that is x * cos + rotate_half(x) * sin).",
        "Addresses: head h of token t starts at x_ptr + (t * n_heads + h) * 2 * HALF (D = 2 * HALF values per "
        "head). h is a column of BLOCK_H heads, d a row of BLOCK_HALF columns: (h, d) addresses a whole tile at once; "
        "the given cos1, cos2, sin1, sin2 have shape (1, BLOCK_HALF) and broadcast over the heads.",
        "Compute in float32 (.to(tl.float32) after each load) and convert once when storing "
        "(.to(out_ptr.dtype.element_ty)). Every load and store of x takes mask=(h < n_heads) & (d < HALF).",
    ],
    "rope_store_kv": [
        "Three jobs per token: q rotated into q_out (as your RoPE kernel did), k rotated, v copied. The only new "
        "thing is where k and v go.",
        "Token t's K row (all Hkv heads, Hkv * D values) goes to cache slot slots[t]: in the contiguous cache that "
        "row starts at slot * n_kv_heads * 2 * HALF. Head h of it: + h * 2 * HALF.",
        "Use two sets of addresses for K: where it is (token * n_kv_heads + h) * 2 * HALF + d and where it goes "
        "(slot * n_kv_heads + h) * 2 * HALF + d, with mask (h < n_kv_heads) & (d < HALF). V: the same two, "
        "copied without rotation, both halves.",
    ],
    "graph_safe_decode_step": [
        "Three things in eager_decode_step break capture: int(lengths[b]) (a host sync), slices whose length "
        "changes every step, and a new output tensor. Remove all three.",
        "Writing at a position held in a tensor: advanced indexing with tensors, "
        "k_cache[torch.arange(B, device=...), :, lengths] = k_new, reads the positions on the device.",
        "A fixed shape: attend over the whole capacity every step and hide positions > lengths[b] with a mask: "
        "visible = torch.arange(capacity, device=...)[None, :] <= lengths[:, None]; reference.attention takes an "
        "additive mask (0 or -inf) broadcastable to (B, H, 1, capacity).",
        "Finish with out.copy_(result), lengths += 1 (in place), and return out.",
    ],
}


def hint(exercise: str, n: int = 1) -> None:
    """Print the ``n``-th hint (from 1) of ``exercise``, and say how many there are."""
    if exercise not in HINTS:
        raise KeyError(f"no hints for {exercise!r}; exercises with hints: {', '.join(sorted(HINTS))}")
    hints = HINTS[exercise]
    if not 1 <= n <= len(hints):
        raise ValueError(f"{exercise} has hints 1 to {len(hints)}, not {n}")
    more = f" (hint({exercise!r}, {n + 1}) says more)" if n < len(hints) else " (the last one)"
    print(f"Hint {n} of {len(hints)} for {exercise}{more}:\n{hints[n - 1]}")
