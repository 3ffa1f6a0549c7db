"""Checkers for the exercises. Each takes the student's function, runs it on fresh random inputs of several odd
shapes and every dtype this mode supports, with outputs poisoned (NaN) first, and either prints one line of success
or raises :class:`ExerciseFailed` with a message that says what to fix.

The notebooks also run these checkers on lessonlib's own kernels, so a broken library kernel fails a notebook loudly.
"""

from __future__ import annotations

import torch

from lessonlib import reference, runtime
from lessonlib.testing import attention_allowance, check_close, poisoned_outputs, to_float64


class ExerciseFailed(AssertionError):
    """The student's code does not (yet) meet the exercise's spec; the message says why."""


def _describe(args) -> str:
    shapes = ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
    return f"inputs of shapes {shapes}, dtype {str(args[0].dtype).removeprefix('torch.')}"


def _call(name: str, fn, args):
    try:
        with poisoned_outputs():
            return fn(*args)
    except NotImplementedError as e:
        raise ExerciseFailed(f"{name}: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
    except Exception as e:  # the student's bug: say where it happened
        raise ExerciseFailed(f"{name} raised {type(e).__name__} on {_describe(args)}: {e}") from e


def _check_output(name: str, out, truth: torch.Tensor, low: torch.Tensor, args) -> None:
    if not isinstance(out, torch.Tensor):
        raise ExerciseFailed(f"{name} returned {type(out).__name__}; expected a torch.Tensor")
    if tuple(out.shape) != tuple(truth.shape):
        raise ExerciseFailed(f"{name} returned shape {tuple(out.shape)} for {_describe(args)}; expected {tuple(truth.shape)}")
    if out.is_floating_point() and out.numel():
        written = int((~torch.isnan(out)).sum())
        if written == 0:
            raise ExerciseFailed(
                f"{name}: not implemented yet: the kernel wrote none of the output (every element is still NaN, "
                "the value these checks fill new outputs with). Fill in the kernel body."
            )
        if written < out.numel():
            first = tuple(int(i) for i in torch.isnan(out).nonzero()[0])
            raise ExerciseFailed(
                f"{name} wrote only {written} of {out.numel()} output elements for {_describe(args)} (first one "
                f"missing at index {first}): does your grid cover every row and block, and your mask every column?"
            )
    try:
        check_close(name, out, truth, low)
    except AssertionError as e:
        raise ExerciseFailed(f"{e}\n  on {_describe(args)}. Compute in float32 and round once when storing.") from None


def _inputs(*shapes, dtype):
    return [torch.randn(s, device=runtime.device(), dtype=torch.float32).to(dtype) for s in shapes]


SWIGLU_SHAPES = [(1, 1), (7, 123), (33, 1000)]
ADD_RMS_NORM_SHAPES = [(1, 8), (5, 123), (16, 1000)]


def check_swiglu(fn) -> None:
    """``fn(gate, up)`` must equal ``silu(gate) * up``."""
    for dtype in runtime.supported_dtypes():
        for shape in SWIGLU_SHAPES:
            gate, up = _inputs(shape, shape, dtype=dtype)
            out = _call("swiglu", fn, (gate, up))
            _check_output("swiglu", out, reference.swiglu(*to_float64(gate, up)), reference.swiglu(gate, up), (gate, up))
    print(f"✓ swiglu matches the reference ({len(SWIGLU_SHAPES)} shapes x every supported dtype)")


def check_add_rms_norm(fn) -> None:
    """``fn(x, residual, weight, eps)`` must return ``(normalized, updated_residual)`` as the reference does."""
    for dtype in runtime.supported_dtypes():
        for shape in ADD_RMS_NORM_SHAPES:
            x, residual, weight = _inputs(shape, shape, shape[-1:], dtype=dtype)
            args = (x, residual, weight, 1e-6)
            result = _call("add_rms_norm", fn, args)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise ExerciseFailed(f"add_rms_norm returned {type(result).__name__}; expected a tuple (normalized, updated_residual)")
            truth = reference.add_rms_norm(*to_float64(x, residual, weight), 1e-6)
            low = reference.add_rms_norm(x, residual, weight, 1e-6)
            _check_output("add_rms_norm: updated_residual", result[1], truth[1], low[1], args)
            _check_output("add_rms_norm: normalized", result[0], truth[0], low[0], args)
    print(f"✓ add_rms_norm matches the reference ({len(ADD_RMS_NORM_SHAPES)} shapes x every supported dtype)")


def check_apply_rope(fn) -> None:
    """``fn(q, k, cos, sin)`` must return ``(q_rot, k_rot)`` as the reference does (GQA: k has fewer heads)."""
    for dtype in runtime.supported_dtypes():
        for batch, heads, kv_heads, seq, dim in [(1, 1, 1, 1, 2), (2, 4, 2, 7, 64), (1, 8, 1, 5, 80)]:
            q, k = _inputs((batch, heads, seq, dim), (batch, kv_heads, seq, dim), dtype=dtype)
            cos, sin = reference.rope_cos_sin(torch.randint(0, 4096, (seq,), device=runtime.device()), dim, dtype=dtype)
            args = (q, k, cos, sin)
            result = _call("apply_rope", fn, args)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise ExerciseFailed(f"apply_rope returned {type(result).__name__}; expected a tuple (q_rot, k_rot)")
            truth = reference.apply_rope(*to_float64(*args))
            low = reference.apply_rope(*args)
            _check_output("apply_rope: q_rot", result[0], truth[0], low[0], args)
            _check_output("apply_rope: k_rot", result[1], truth[1], low[1], args)
    print("✓ apply_rope matches the reference (3 shapes x every supported dtype)")


def check_blocks_needed(fn) -> None:
    """``fn(prompt_tokens, max_tokens, block_size)`` predicts how many KV-cache blocks vLLM's block manager holds for
    one request at its peak. Checked against the engine itself: each prediction is compared with the blocks the
    engine's manager really allocated for a request of that many prompt tokens and generated tokens."""
    import random

    from lessonlib import serving  # first: it fixes Triton's mode before vllm imports triton

    from vllm import SamplingParams

    llm = serving.engine()
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    rng = random.Random()
    cases = [(block_size, 1), (block_size, 2), (block_size - 1, 2), (1, 1), (1, block_size)]
    cases += [(rng.randrange(1, 4 * block_size), rng.randrange(1, 3 * block_size)) for _ in range(3)]
    prompts = [[rng.randrange(10, 400) for _ in range(prompt_tokens)] for prompt_tokens, _ in cases]
    for (prompt_tokens, max_tokens), prompt in zip(cases, prompts):
        try:
            predicted = fn(prompt_tokens, max_tokens, block_size)
        except NotImplementedError as e:
            raise ExerciseFailed(f"blocks_needed: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        _, [trace] = serving.generate_tracing_blocks(
            llm, [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
        if predicted != trace.peak_blocks:
            raise ExerciseFailed(
                f"blocks_needed({prompt_tokens}, {max_tokens}, {block_size}) = {predicted}, but the engine held "
                f"{trace.peak_blocks} blocks for a {prompt_tokens}-token prompt generating {max_tokens} tokens. "
                "Which tokens' K and V does the engine ever write? (Think about the very last token it samples.)")
    print(f"blocks_needed: correct on {len(cases)} requests, each checked against vLLM's own block manager")


def check_online_softmax_update(fn) -> None:
    """``fn(m, l, acc, scores, values) -> (m, l, acc)``: fold one tile of keys into the online-softmax state of a
    block of query rows. m, l: (R,) running max and sum; acc: (R, D) unnormalised output; scores: (R, C) this tile's
    scores; values: (C, D). Starting from m = -inf, l = 0, acc = 0 and folding every tile must give softmax · V."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for rows, keys, head_dim, block in ((1, 5, 4, 5), (3, 37, 8, 8), (4, 64, 16, 16), (2, 50, 8, 7)):
        scores = torch.randn(rows, keys, generator=generator, dtype=torch.float64) * 4
        scores[0, keys // 2] = 30.0  # a large score in a late tile: the old sum must be rescaled, not overflow
        values = torch.randn(keys, head_dim, generator=generator, dtype=torch.float64)
        m = torch.full((rows,), float("-inf"), dtype=torch.float64)
        l = torch.zeros(rows, dtype=torch.float64)
        acc = torch.zeros(rows, head_dim, dtype=torch.float64)
        for start in range(0, keys, block):
            try:
                m, l, acc = fn(m, l, acc, scores[:, start:start + block], values[start:start + block])
            except NotImplementedError as e:
                raise ExerciseFailed(f"online_softmax_update: not implemented yet ({str(e) or 'NotImplementedError'}). "
                                     "Fill in the stub.") from None
            seen = min(start + block, keys)
            want_m = scores[:, :seen].max(dim=1).values
            if not torch.allclose(m, want_m):
                raise ExerciseFailed(f"online_softmax_update: after {seen} keys the running max is {m.tolist()}, "
                                     f"expected {want_m.tolist()}")
            want_l = torch.exp(scores[:, :seen] - want_m[:, None]).sum(dim=1)
            if not torch.allclose(l, want_l, rtol=1e-12):
                raise ExerciseFailed(f"online_softmax_update: after {seen} keys l = {l.tolist()}, expected "
                                     f"{want_l.tolist()} (sum of exp(score - running max)). Did you rescale the old "
                                     "sum by exp(old max - new max)?")
        exact = torch.softmax(scores, dim=1) @ values
        if not torch.allclose(acc / l[:, None], exact, rtol=1e-10, atol=1e-12):
            raise ExerciseFailed("online_softmax_update: acc / l differs from softmax(scores) @ values: rescale acc "
                                 "by the same factor as l before adding this tile's exp(scores - m) @ values")
    print("online_softmax_update: correct on 4 problems (float64, exact to rounding), including a late large score")


def check_key_tile_bound(fn) -> None:
    """``fn(start_m, block_m, n_q, n_kv) -> int``: with the end-aligned causal mask (query i sees keys
    j <= i + n_kv - n_q), the end (exclusive) of the keys that the query tile [start_m, start_m + block_m) must
    visit; keys from there on are above the diagonal for every real query in the tile. 0 if none is visible."""
    from lessonlib.reference import causal_mask

    cases = [(0, 16, 64, 64), (48, 16, 64, 64), (0, 16, 9, 70), (32, 16, 40, 7), (0, 16, 40, 7), (32, 16, 33, 33),
             (16, 32, 40, 100)]
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(30):
        block_m = int(2 ** torch.randint(2, 7, (), generator=generator))
        n_q, n_kv = (int(torch.randint(1, 300, (), generator=generator)) for _ in range(2))
        start_m = int(torch.randint(0, -(-n_q // block_m), (), generator=generator)) * block_m
        cases.append((start_m, block_m, n_q, n_kv))
    for start_m, block_m, n_q, n_kv in cases:
        visible = causal_mask(n_q, n_kv)[start_m:start_m + block_m]
        want = int(visible.any(dim=0).nonzero().max()) + 1 if visible.any() else 0
        try:
            got = fn(start_m, block_m, n_q, n_kv)
        except NotImplementedError as e:
            raise ExerciseFailed(f"key_tile_bound: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        if got != want:
            raise ExerciseFailed(
                f"key_tile_bound(start_m={start_m}, block_m={block_m}, n_q={n_q}, n_kv={n_kv}) = {got}, expected "
                f"{want}. The tile's last real query is min(start_m + block_m, n_q) - 1; it sees keys up to that "
                "+ (n_kv - n_q); clamp to [0, n_kv].")
    print(f"key_tile_bound: correct on {len(cases)} tiles (including Nq > Nkv and partial last tiles)")


def check_flash_attention(fn) -> None:
    """``fn(q, k, v, causal=...)``: attention as ``lessonlib.reference.attention``, forward and backward, on odd
    lengths, GQA and both masks, outputs poisoned first; within the tolerance rule of lessonlib.testing."""
    from lessonlib.ops.flash_attention import flash_attention_dtypes
    from lessonlib.testing import check_attention

    for dtype in flash_attention_dtypes():
        for (batch, heads, kv_heads, n_q, n_kv, head_dim, causal) in ((1, 2, 2, 17, 17, 32, True),
                                                                     (2, 4, 1, 9, 40, 16, True),
                                                                     (1, 4, 2, 33, 20, 64, False)):
            q, k, v = _inputs((batch, heads, n_q, head_dim), (batch, kv_heads, n_kv, head_dim),
                              (batch, kv_heads, n_kv, head_dim), dtype=dtype)
            try:
                check_attention(fn, q, k, v, causal)
            except NotImplementedError as e:
                raise ExerciseFailed(f"flash_attention: not implemented yet ({str(e) or 'NotImplementedError'})") from None
            except AssertionError as e:
                raise ExerciseFailed(f"{e}\n  on q {tuple(q.shape)}, k/v {tuple(k.shape)}, {dtype}, causal={causal}") from None
    print("flash_attention: forward and backward within tolerance on odd lengths, GQA, causal and full, "
          f"{', '.join(str(d).removeprefix('torch.') for d in flash_attention_dtypes())}")


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
    print(f"physical_slot: correct on {len(cases)} positions, including the seed's table 17 4 29 8")


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
    print("free_sequence: correct on 20 pools with shared prefixes, double frees refused with nothing changed")


def check_no_graph_break(fn) -> None:
    """``fn(x)`` must compute ``x / max|x| * 2`` (as ``scale_by_max`` in notebook 04 does) with no graph break:
    torch._dynamo.explain must find one graph, and the compiled result must match the eager one."""
    from lessonlib.compiler import graph_breaks

    for shape in ((7,), (4, 33), (2, 3, 5)):
        x = torch.randn(shape, dtype=torch.float32) * 3
        want = x / x.abs().max() * 2.0
        try:
            breaks = graph_breaks(fn, x)
            got = torch.compile(fn, fullgraph=True)(x)
        except NotImplementedError as e:
            raise ExerciseFailed(f"no_graph_break: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        except Exception as e:  # fullgraph=True raises on the first graph break
            raise ExerciseFailed(f"no_graph_break: torch.compile(fullgraph=True) failed: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:300]}") from None
        if breaks:
            raise ExerciseFailed(f"no_graph_break: still {len(breaks)} graph break(s): {breaks[0].reason} at {breaks[0].where}")
        torch.testing.assert_close(got, want)
    print("no_graph_break: one graph, no break, same result as eager on 3 shapes")


def check_refresh_static_inputs(fn) -> None:
    """``fn(static, new) -> None``: before a CUDA-graph replay, put the values of the tensors in ``new`` (a dict of
    name -> tensor) into the graph's ``static`` tensors (same names, shapes, dtypes), in place. A replay reads the
    addresses recorded at capture: rebinding a name to a new tensor, or replacing it in the dict, changes nothing
    the graph will see."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for trial in range(5):
        shapes = {"hidden": (3, 8), "slots": (3,), "block_table": (3, 4), "seq_lens": (3,)}
        static = {name: torch.zeros(shape) for name, shape in shapes.items()}
        addresses = {name: t.data_ptr() for name, t in static.items()}
        originals = dict(static)
        new = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
        try:
            result = fn(static, new)
        except NotImplementedError as e:
            raise ExerciseFailed(f"refresh_static_inputs: not implemented yet ({str(e) or 'NotImplementedError'}). "
                                 "Fill in the stub.") from None
        for name in shapes:
            if static[name] is not originals[name] or static[name].data_ptr() != addresses[name]:
                raise ExerciseFailed(f"refresh_static_inputs: static[{name!r}] is a different tensor now; the graph "
                                     "still reads the old one. Copy into it in place (Tensor.copy_).")
            if not torch.equal(originals[name], new[name]):
                raise ExerciseFailed(f"refresh_static_inputs: static[{name!r}] does not hold the new values")
        if result is not None:
            raise ExerciseFailed("refresh_static_inputs: work in place and return None")
    print("refresh_static_inputs: new values in the captured tensors, every address unchanged")


def check_can_admit(fn) -> None:
    """``fn(prompt_blocks, cached_idle_blocks, cached_busy_blocks, free_blocks, running, max_num_seqs, new_tokens,
    batched_tokens, max_batched_tokens) -> bool``: the engine's admission rule (``lessonlib.engine.can_admit``),
    checked against it on the edge cases and on random situations."""
    import random

    from lessonlib.engine import can_admit

    base = dict(prompt_blocks=4, cached_idle_blocks=0, cached_busy_blocks=0, free_blocks=4, running=0,
                max_num_seqs=2, new_tokens=64, batched_tokens=0, max_batched_tokens=100)
    hints = [
        ({}, "a prompt whose blocks are all free fits"),
        ({"free_blocks": 3}, "one block short: it must wait"),
        ({"free_blocks": 2, "cached_busy_blocks": 2}, "blocks another sequence holds are shared: they cost no free block"),
        ({"free_blocks": 2, "cached_idle_blocks": 2}, "a cached block in the free list still leaves the free list when reused"),
        ({"running": 2}, "the batch is full (max_num_seqs)"),
        ({"batched_tokens": 50}, "this step's token budget would overflow"),
        ({"new_tokens": 500}, "a lone prompt always fits the token budget (else it could never run)"),
    ]
    rng = random.Random()
    for _ in range(200):
        blocks = rng.randrange(1, 9)
        idle = rng.randrange(0, blocks + 1)
        busy = rng.randrange(0, blocks - idle + 1)
        hints.append(({"prompt_blocks": blocks, "cached_idle_blocks": idle, "cached_busy_blocks": busy,
                       "free_blocks": rng.randrange(0, 9), "running": rng.randrange(0, 3),
                       "new_tokens": rng.randrange(1, 120), "batched_tokens": rng.choice([0, rng.randrange(1, 100)])},
                      "a random situation"))
    for change, hint in hints:
        args = {**base, **change}
        try:
            got = fn(**args)
        except NotImplementedError as e:
            raise ExerciseFailed(f"can_admit: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        want = can_admit(**args)
        if bool(got) != want:
            raise ExerciseFailed(f"can_admit{args} returned {got}, expected {want}: {hint}")
    print(f"✓ can_admit agrees with the engine's rule on {len(hints)} situations")


def check_top_p_filter(fn) -> None:
    """``fn(probs, top_p) -> probs``: keep in each row the smallest set of most likely tokens whose probabilities sum
    to at least top_p, zero the rest and renormalise (``lessonlib.engine.top_p_filter``)."""
    from lessonlib.engine import top_p_filter

    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    cases = [(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([0.5]), "exactly 0.5 is reached by the top token alone"),
             (torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([0.6]), "0.5 < 0.6: the second token is needed too"),
             (torch.tensor([[0.2, 0.5, 0.3]]), torch.tensor([1.0]), "top_p = 1 keeps everything"),
             (torch.tensor([[0.1, 0.7, 0.2]]), torch.tensor([1e-9]), "a tiny top_p keeps the most likely token only")]
    for _ in range(5):
        vocab = int(torch.randint(1, 40, (), generator=generator))
        probs = torch.softmax(3 * torch.randn(4, vocab, generator=generator), dim=-1)
        cases.append((probs, torch.rand(4, generator=generator).clamp_min(1e-3), "random rows"))
    for probs, top_p, hint in cases:
        try:
            got = fn(probs.clone(), top_p.clone())
        except NotImplementedError as e:
            raise ExerciseFailed(f"top_p_filter: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        want = top_p_filter(probs, top_p)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise ExerciseFailed(f"top_p_filter returned {type(got).__name__} {getattr(got, 'shape', '')}; expected a "
                                 f"tensor of shape {tuple(want.shape)}")
        if not torch.allclose(got, want, atol=1e-6):
            raise ExerciseFailed(f"top_p_filter({probs.tolist()[0][:5]}..., top_p={top_p.tolist()[0]:.3g}) gave "
                                 f"{got.tolist()[0][:5]}..., expected {want.tolist()[0][:5]}...: {hint}")
    print(f"✓ top_p_filter keeps the nucleus and renormalises ({len(cases)} cases)")


# =================================================================================================================
# Kernel exercises (issue 15): the student writes the kernels. Each exercise has a launcher (given: it validates
# the inputs and launches the student's @triton.jit kernel), a checker that runs it on odd shapes with outputs
# poisoned, and a diagnosis: when the output is wrong, the checker compares it with what known mistakes produce
# (computed in float64 PyTorch) and names the mistake it matches. A stub compiles (its body is `pass`) and leaves
# the output NaN or zero: both are reported as "not implemented yet".
# =================================================================================================================


def _not_implemented_output(name: str, out: torch.Tensor, truth: torch.Tensor) -> None:
    """An all-zero output where the truth is not zero: the state a stub leaves (acc = 0, or nothing loaded)."""
    if out.numel() and not out.isnan().any() and not out.any() and truth.abs().max() > 0:
        raise ExerciseFailed(f"{name}: not implemented yet: your kernel wrote zeros everywhere (the state it starts "
                             "from). Fill in the part marked YOUR CODE HERE.")


def _diagnose(name: str, out: torch.Tensor, truth: torch.Tensor, low: torch.Tensor, mistakes, where: str,
              allowance: float = 0.0) -> None:
    """Pass if ``out`` is within the tolerance rule of ``truth``; else name the first known mistake whose float64
    output ``out`` matches (within the same tolerance) and which differs from the truth, else report the error.
    ``mistakes``: (explanation, float64 output) pairs, or a callable returning them (computed only on failure).
    ``allowance``: attention's score roundings (``testing.attention_allowance``)."""
    try:
        check_close(name, out, truth, low, allowance=allowance)
        return
    except AssertionError as e:
        failure = str(e)
    if out.isnan().any():
        raise ExerciseFailed(f"{failure}\n  on {where}")
    from lessonlib.testing import tolerance

    allowed = tolerance(truth, low.cpu(), out.dtype) + allowance
    got = out.detach().double().cpu()
    for explanation, wrong in (mistakes() if callable(mistakes) else mistakes):
        wrong = wrong.detach().double().cpu()
        off = (wrong - truth.cpu()).abs().max().item()
        # A mistake's own low-precision error is not known: allow 4x the truth's tolerance and 2% of how far the
        # mistake lies from the truth, far closer than any other wrong answer comes.
        if off > allowed and (got - wrong).abs().max().item() <= 4 * allowed + 0.02 * off:
            raise ExerciseFailed(f"{name}: wrong values on {where}. They are what {explanation}")
    raise ExerciseFailed(f"{failure}\n  on {where}")


# --- 1. The FlashAttention forward kernel (notebook 02) ----------------------------------------------------------


def flash_forward_config() -> dict:
    """Tiles for the exercise kernel: 16 x 16 in the interpreter (cheap steps, and shapes of 45 or 100 keys span
    several tiles); 32 x 32 on a GPU, still several tiles on the checker's shapes (the rescale must be exercised)."""
    if runtime.on_gpu():
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4)
    return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)


def flash_forward(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  config: dict | None = None) -> torch.Tensor:
    """Launch the exercise's forward kernel: one program per (query tile, batch x head), as lessonlib's kernel.

    q: (B, H, Nq, D); k, v: (B, Hkv, Nkv, D); H a multiple of Hkv, D in {16, 32, 64, 128}. Inputs are made
    contiguous, so row n of head (b, h) starts at ((b * H + h) * N + n) * D. Returns out like q."""
    import triton

    from lessonlib.ops._common import launch
    from lessonlib.ops.flash_attention import check_inputs

    check_inputs(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, heads, n_q, head_dim = q.shape
    config = config or flash_forward_config()
    out = torch.empty_like(q)
    grid = (triton.cdiv(n_q, config["BLOCK_M"]), batch * heads)
    launch(kernel, grid, q, k, v, out, n_q, k.shape[2], head_dim ** -0.5, GROUP=heads // k.shape[1],
           CAUSAL=bool(causal), HEAD_DIM=head_dim, **config)
    return out


def _attention_masked(q, k, v, visible: torch.Tensor, scale: float | None = None, kv_index=None):
    """float64 attention with an explicit (Nq, Nkv) visibility mask; a row that sees nothing gives 0.
    ``kv_index``: the KV head each query head reads (default: h // group)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_index is None:
        kv_index = torch.arange(heads) // (heads // kv_heads)
    k, v = k[:, kv_index], v[:, kv_index]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


def _flash_forward_without_rescale(q, k, v, visible, block_n: int, rescale_acc: bool, rescale_l: bool):
    """The tile loop in float64 with acc and/or l never multiplied by alpha = exp(m_old - m_new)."""
    kv_index = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    k, v = k[:, kv_index], v[:, kv_index]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    m = torch.full(scores.shape[:-1], -1e30, dtype=scores.dtype)
    l = torch.zeros_like(m)
    acc = torch.zeros(*scores.shape[:-1], v.shape[-1], dtype=scores.dtype)
    for start in range(0, scores.shape[-1], block_n):
        s = scores[..., start:start + block_n]
        m_new = torch.maximum(m, s.max(dim=-1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = (l * alpha if rescale_l else l) + p.sum(-1)
        acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ v[..., start:start + block_n, :]
        m = m_new
    return acc / torch.where(l > 0, l, 1.0)[..., None]


def _flash_forward_mistakes(q, k, v, causal: bool, block_n: int):
    from lessonlib.reference import causal_mask

    n_q, n_kv = q.shape[2], k.shape[2]
    i, j = torch.arange(n_q)[:, None], torch.arange(n_kv)[None, :]
    visible = causal_mask(n_q, n_kv) if causal else torch.ones(n_q, n_kv, dtype=torch.bool)
    for rescale_acc, rescale_l, what in ((False, False, "never rescales acc nor l"), (False, True, "rescales l but not acc"),
                                         (True, False, "rescales acc but not l")):
        yield (f"a kernel that {what} when the running max grows gives: both were summed under the old max; "
               "multiply l and acc by alpha = exp(m_old - m_new) before adding this tile",
               _flash_forward_without_rescale(q, k, v, visible, block_n, rescale_acc, rescale_l))
    yield ("scores without the 1/sqrt(D) scale give: multiply q @ k^T by sm_scale",
           _attention_masked(q, k, v, visible, scale=1.0))
    if causal:
        offset = n_kv - n_q
        yield ("attention without the causal mask gives: with CAUSAL, hide keys j > i + (Nkv - Nq) and stop the "
               "loop there", _attention_masked(q, k, v, torch.ones_like(visible)))
        yield ("a causal mask off by one (each query misses its own key, j < i + offset) gives: query i sees key "
               "j exactly when j <= i + (Nkv - Nq)", _attention_masked(q, k, v, j < i + offset))
        yield ("a causal mask off by one (each query also sees the next key, j <= i + offset + 1) gives: query i "
               "sees key j exactly when j <= i + (Nkv - Nq)", _attention_masked(q, k, v, j <= i + offset + 1))
        yield ("a causal mask aligned to the start (j <= i, ignoring Nkv - Nq) gives: the mask is aligned to the "
               "end, query i sees keys j <= i + (Nkv - Nq)", _attention_masked(q, k, v, j <= i))
        # The loop's bound: key tiles [0, hi) are visited, hi from the tile's last real row, whole tiles at a time.
        # One short: where hi falls on a tile boundary, the tile's last row misses its diagonal key.
        block_m = flash_forward_config()["BLOCK_M"]
        last_row = torch.clamp((i // block_m + 1) * block_m, max=n_q) - 1
        tile_hi = -(-torch.clamp(last_row + offset, 0, n_kv) // block_n) * block_n
        yield ("a loop that stops one key early (hi = last row + offset, exclusive) gives: the tile's last real "
               "query sees keys up to last row + offset inclusive, so hi = min(start_m + BLOCK_M, Nq) + Nkv - Nq",
               _attention_masked(q, k, v, visible & (j < tile_hi)))
    else:
        padded = -(-n_kv // block_n) * block_n  # keys past the end loaded as 0 (score 0, value 0) and not masked
        pad = (0, 0, 0, padded - n_kv)
        yield ("a last key tile without a bounds mask gives: keys past Nkv were loaded as 0 and each still added "
               "exp(0 - m) to l; set their scores to -inf",
               _attention_masked(q, torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad),
                                 torch.ones(n_q, padded, dtype=torch.bool)))


FLASH_FORWARD_CASES = (  # (batch, heads, kv_heads, n_q, n_kv, head_dim, causal); cheap cases first: a mistake fails fast
    (1, 1, 1, 1, 1, 16, False),
    (1, 2, 2, 7, 7, 16, True),
    (1, 2, 2, 40, 9, 16, True),  # Nq > Nkv: the first 31 queries see no key (output 0)
    (1, 2, 2, 45, 45, 32, True),
    (1, 2, 1, 100, 100, 16, True),  # GQA, several key tiles per query tile: the rescale matters
    (1, 4, 1, 20, 67, 16, True),  # MQA, Nq < Nkv: new queries after a cached prefix
    (1, 2, 1, 45, 100, 32, False),  # a ragged last key tile, not hidden by a causal mask
)


def check_flash_forward_kernel(kernel) -> None:
    """``kernel``: the exercise's @triton.jit forward kernel, launched by :func:`flash_forward`. Checked against
    float64 attention on odd lengths (1, 7, 45, 100), GQA and MQA, causal with Nq != Nkv, in every dtype the
    FlashAttention kernels take here, outputs poisoned; a wrong answer is matched against known mistakes."""
    from lessonlib.ops.flash_attention import flash_attention_dtypes

    block_n = flash_forward_config()["BLOCK_N"]
    for dtype in flash_attention_dtypes():
        for batch, heads, kv_heads, n_q, n_kv, head_dim, causal in FLASH_FORWARD_CASES:
            q, k, v = _inputs((batch, heads, n_q, head_dim), (batch, kv_heads, n_kv, head_dim),
                              (batch, kv_heads, n_kv, head_dim), dtype=dtype)
            where = (f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, {str(dtype).removeprefix('torch.')}, "
                     f"causal={causal}")
            out = _call("flash_forward", lambda *a: flash_forward(kernel, *a, causal=causal), (q, k, v))
            if not isinstance(out, torch.Tensor) or out.shape != q.shape:
                raise ExerciseFailed(f"flash_forward returned {getattr(out, 'shape', out)!r}; expected {tuple(q.shape)}")
            truth = reference.attention(*to_float64(q, k, v), causal=causal)
            if out.isnan().all():
                raise ExerciseFailed("flash_forward: not implemented yet: the kernel stored nothing (the output is "
                                     "still NaN, as these checks fill it). Fill in the kernel body.")
            _not_implemented_output("flash_forward", out, truth)
            q64, k64, v64 = (t.cpu() for t in to_float64(q, k, v))
            _diagnose("flash_forward", out, truth, reference.attention(q, k, v, causal=causal),
                      lambda: _flash_forward_mistakes(q64, k64, v64, causal, block_n), where,
                      attention_allowance(q, k, v))
    print(f"flash_forward: your kernel matches float64 attention on {len(FLASH_FORWARD_CASES)} shapes (N = 1, 7, 45, "
          "100; GQA, MQA; causal with Nq < Nkv and Nq > Nkv) in "
          f"{', '.join(str(d).removeprefix('torch.') for d in flash_attention_dtypes())}"
          f"{' on the GPU' if runtime.on_gpu() else ' (Triton interpreter)'}")


# --- 2. The paged attention kernel's block-table walk (notebook 03) ----------------------------------------------


def paged_decode(kernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:
    """Launch the exercise's decode kernel: one program per (sequence, query head). Inputs as
    ``lessonlib.reference.paged_attention``: q (B, H, D); caches (num_blocks, block_size, Hkv, D) contiguous with
    block_size and D powers of two (tl.arange needs them); block_table (B, max_blocks) int32; seq_lens (B,) int32,
    each at least 1. Validated as lessonlib's kernel validates them, tables included. Returns (B, H, D)."""
    from lessonlib.ops._common import launch
    from lessonlib.ops.paged_attention import check_inputs

    check_inputs(q, k_cache, v_cache, block_table, seq_lens)  # shapes, dtypes, devices, and the tables' range
    q = q.contiguous()
    batch, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    launch(kernel, (batch, heads), q, k_cache, v_cache, block_table.contiguous(), seq_lens, out,
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
    sizes 16 and 32, lengths 1 to 100 (not multiples of the block size), in every supported dtype."""
    for dtype in runtime.supported_dtypes():
        for batch, heads, kv_heads, head_dim, block_size, lengths in PAGED_DECODE_CASES:
            args = _paged_inputs(batch, heads, kv_heads, head_dim, block_size, lengths, dtype)
            q, k_cache, v_cache, table, seq_lens = args
            where = (f"{batch} sequences of {list(lengths)} tokens, {heads} query heads over {kv_heads} KV heads, "
                     f"block_size {block_size}, {str(dtype).removeprefix('torch.')}, block table {table.tolist()}")
            out = _call("paged_decode", lambda *a: paged_decode(kernel, *a), args)
            truth = reference.paged_attention(*to_float64(q, k_cache, v_cache), table, seq_lens)
            if out.isnan().all():
                raise ExerciseFailed("paged_decode: not implemented yet: the kernel stored nothing. Fill in the walk.")
            _not_implemented_output("paged_decode", out, truth)
            cpu64 = [t.cpu() for t in to_float64(q, k_cache, v_cache)]
            _diagnose("paged_decode", out, truth, reference.paged_attention(*args),
                      lambda: _paged_decode_mistakes(*cpu64, table.cpu(), seq_lens.cpu()), where,
                      attention_allowance(q, k_cache, v_cache))
    print(f"paged_decode: your block-table walk reads the right K/V rows on {len(PAGED_DECODE_CASES)} pools (shuffled "
          "tables, GQA, block sizes 16 and 32, lengths 1-100), within tolerance of float64")


# --- 3. A RoPE kernel, then RoPE fused with the KV-cache write (notebook 03) --------------------------------------


def _rope_launch_sizes(n_heads: int, head_dim: int) -> dict:
    from lessonlib.ops._common import next_power_of_2

    return dict(HALF=head_dim // 2, BLOCK_H=next_power_of_2(n_heads), BLOCK_HALF=next_power_of_2(head_dim // 2))


def _check_rope_args(op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    from lessonlib.ops._common import check_tensors

    check_tensors(op, x=x, cos=cos, sin=sin)
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"{op}: x must be (T, H, D) with D even, got {tuple(x.shape)}")
    if cos.shape != (x.shape[0], x.shape[2]) or sin.shape != cos.shape:
        raise ValueError(f"{op}: cos and sin must be (T, D) = {(x.shape[0], x.shape[2])}, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")


def rope(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Launch the exercise's RoPE kernel, one program per token. x: (T, H, D), D even, the new tokens' queries or
    keys as a projection returns them; cos, sin: (T, D), each token's angles (``reference.rope_cos_sin``).
    Returns x rotated, (T, H, D), as ``reference.apply_rope`` rotates it."""
    from lessonlib.ops._common import launch

    _check_rope_args("rope", x, cos, sin)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    sizes = _rope_launch_sizes(x.shape[1], x.shape[2])
    # A guard zone after the output, as large as one program's padded tile: a store that a missing mask lets run
    # past the end lands there (and is reported) instead of corrupting memory and killing the notebook's kernel.
    guard = sizes["BLOCK_H"] * 4 * sizes["BLOCK_HALF"]
    buffer = torch.full((x.numel() + guard,), float("nan"), dtype=x.dtype, device=x.device)
    out = buffer[: x.numel()].view(x.shape)
    if x.numel():
        launch(kernel, (x.shape[0],), x, cos, sin, out, x.shape[1], **sizes, num_warps=1 if not runtime.on_gpu() else 4)
    if not buffer[x.numel():].isnan().all():
        raise ValueError("rope: the kernel wrote past the end of its output: every store needs its mask "
                         "(heads h < n_heads, columns d < HALF)")
    return out


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """reference.apply_rope for token-major x (T, H, D): RoPE is per (token, head), so the layout is a view."""
    rotated, _ = reference.apply_rope(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    return rotated[0].transpose(0, 1)


def _rope_mistakes(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    right = _rope_reference(x, cos, sin)
    yield ("a rotation by -angle gives (the sign of sin flipped): rotate_half(x) = (-x2, x1), so the first half is "
           "x1 * cos - x2 * sin and the second x2 * cos + x1 * sin", torch.cat((x1 * c + x2 * s, x2 * c - x1 * s), -1))
    yield ("the two halves swapped on the way out give: the first half of the output is x1 * cos - x2 * sin, "
           "stored at d, the second at d + HALF", torch.cat((right[..., half:], right[..., :half]), -1))
    even, odd = x[..., 0::2], x[..., 1::2]
    yield ("rotating interleaved pairs (x0, x1), (x2, x3)... gives (GPT-J's convention): Llama's rotate_half pairs "
           "element d with element d + HALF", torch.stack((even * c - odd * s, odd * c + even * s), -1).flatten(-2))
    yield ("x left unrotated gives: multiply by cos and sin", x)
    yield ("a first half computed as x1 * cos + x2 * sin gives: rotate_half(x) = (-x2, x1), so the first half is "
           "x1 * cos - x2 * sin", torch.cat((x1 * c + x2 * s, right[..., half:]), -1))
    yield ("a second half computed as x2 * cos - x1 * sin gives: rotate_half(x) = (-x2, x1), so the second half is "
           "x2 * cos + x1 * sin", torch.cat((right[..., :half], x2 * c - x1 * s), -1))


ROPE_CASES = ((1, 1, 2), (7, 3, 64), (33, 8, 80), (5, 2, 6))  # (tokens, heads, head_dim): D/2 of 40 and 3 not powers of 2


def _rope_inputs(tokens, heads, head_dim, dtype):
    (x,) = _inputs((tokens, heads, head_dim), dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), device=runtime.device())
    cos, sin = reference.rope_cos_sin(positions, head_dim, dtype=dtype)
    return x, cos, sin


def check_rope_kernel(kernel) -> None:
    """``kernel``: the exercise's @triton.jit RoPE kernel, launched by :func:`rope`. Checked against
    ``reference.apply_rope`` in float64 on 1 to 33 tokens, 1 to 8 heads, head_dim 2 to 80 (half not a power of
    two), random positions up to 4096, every supported dtype, outputs poisoned."""
    for dtype in runtime.supported_dtypes():
        for tokens, heads, head_dim in ROPE_CASES:
            x, cos, sin = _rope_inputs(tokens, heads, head_dim, dtype)
            where = f"x {tuple(x.shape)}, {str(dtype).removeprefix('torch.')}"
            out = _call("rope", lambda *a: rope(kernel, *a), (x, cos, sin))
            truth = _rope_reference(*to_float64(x, cos, sin))
            _check_output_written("rope", out, truth, where)
            cpu64 = [t.cpu() for t in to_float64(x, cos, sin)]
            _diagnose("rope", out, truth, _rope_reference(x, cos, sin), lambda: _rope_mistakes(*cpu64), where)
    print(f"rope: your kernel matches reference.apply_rope on {len(ROPE_CASES)} shapes (head_dim 2 to 80) in "
          f"{', '.join(str(d).removeprefix('torch.') for d in runtime.supported_dtypes())}")


def _check_output_written(name: str, out, truth: torch.Tensor, where: str) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(truth.shape):
        raise ExerciseFailed(f"{name} returned {getattr(out, 'shape', type(out).__name__)}; expected shape "
                             f"{tuple(truth.shape)}")
    if out.numel() and out.isnan().all():
        raise ExerciseFailed(f"{name}: not implemented yet: the kernel stored nothing (every element is still NaN, "
                             "the value these checks fill outputs with). Fill in the kernel body.")
    if out.isnan().any():
        first = tuple(int(i) for i in out.isnan().nonzero()[0])
        raise ExerciseFailed(f"{name} left some elements unwritten (first at index {first}) on {where}: does the "
                             "mask cover every head and both halves?")


def rope_store_kv(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Launch the exercise's fused kernel, one program per new token: rotate q (returned) and k, and write k and v
    straight into their cache slots. q: (T, H, D); k, v: (T, Hkv, D); cos, sin: (T, D); caches (num_blocks,
    block_size, Hkv, D) contiguous; slots: (T,) int64, distinct, inside the pool (checked, as store_kv checks)."""
    from lessonlib.ops._common import launch

    from lessonlib.ops._common import check_tensors

    check_tensors("rope_store_kv", q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    _check_rope_args("rope_store_kv", q, cos, sin)
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[0] != q.shape[0] or t.shape[2] != q.shape[2]:
            raise ValueError(f"rope_store_kv: {name} must be (T, Hkv, D) = ({q.shape[0]}, Hkv, {q.shape[2]}), "
                             f"got {tuple(t.shape)}")
    if k.shape != v.shape or k_cache.shape != v_cache.shape or k_cache.dim() != 4 or \
            tuple(k_cache.shape[2:]) != tuple(k.shape[1:]) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"rope_store_kv: caches must be contiguous (num_blocks, block_size, {k.shape[1]}, "
                         f"{k.shape[2]}), got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.shape != (q.shape[0],):
        raise TypeError(f"rope_store_kv: slots must be an int64 tensor of shape ({q.shape[0]},)")
    if slots.device != q.device:
        raise ValueError(f"rope_store_kv: slots on {slots.device}, q on {q.device}")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if bool(((slots < 0) | (slots >= num_slots)).any()) or torch.unique(slots).numel() != slots.numel():
        raise ValueError(f"rope_store_kv: slots must be distinct and in [0, {num_slots})")
    q, k, v, cos, sin = (t.contiguous() for t in (q, k, v, cos, sin))
    q_out = torch.empty_like(q)
    sizes = _rope_launch_sizes(q.shape[1], q.shape[2])
    from lessonlib.ops._common import next_power_of_2

    launch(kernel, (q.shape[0],), q, k, v, cos, sin, slots, q_out, k_cache, v_cache, q.shape[1], k.shape[1],
           HALF=sizes["HALF"], BLOCK_HQ=sizes["BLOCK_H"], BLOCK_HKV=next_power_of_2(k.shape[1]),
           BLOCK_HALF=sizes["BLOCK_HALF"], num_warps=1 if not runtime.on_gpu() else 4)
    return q_out


ROPE_STORE_KV_CASES = ((1, 1, 1, 2, 4), (7, 4, 2, 64, 4), (13, 8, 1, 80, 16))  # (tokens, H, Hkv, D, block_size)


def check_rope_store_kv_kernel(kernel) -> None:
    """``kernel``: the exercise's fused RoPE + cache-write kernel, launched by :func:`rope_store_kv`. Checked
    against ``reference.apply_rope`` followed by the cache write ``store_kv`` does (vLLM's reshape_and_cache): the
    rotated q returned, rotated k and plain v in each token's slot (poisoned with NaN before the call), and every
    other slot of the pool unchanged, bit for bit."""
    for dtype in runtime.supported_dtypes():
        for tokens, heads, kv_heads, head_dim, block_size in ROPE_STORE_KV_CASES:
            q, cos, sin = _rope_inputs(tokens, heads, head_dim, dtype)
            k, v = _inputs((tokens, kv_heads, head_dim), (tokens, kv_heads, head_dim), dtype=dtype)
            num_blocks = -(-tokens // block_size) + 2
            k_cache, v_cache = _inputs(*[(num_blocks, block_size, kv_heads, head_dim)] * 2, dtype=dtype)
            slots = torch.randperm(num_blocks * block_size, device=runtime.device())[:tokens]
            flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
            flat_k[slots], flat_v[slots] = float("nan"), float("nan")  # what the kernel must overwrite
            k_before, v_before = k_cache.clone(), v_cache.clone()
            where = f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, slots {slots.tolist()}, {str(dtype).removeprefix('torch.')}"
            q_out = _call("rope_store_kv", lambda *a: rope_store_kv(kernel, *a),
                          (q, k, v, cos, sin, k_cache, v_cache, slots))
            q64, k64, v64, cos64, sin64 = (t.cpu() for t in to_float64(q, k, v, cos, sin))
            if isinstance(q_out, torch.Tensor) and q_out.isnan().all() and flat_k[slots].isnan().all() \
                    and flat_v[slots].isnan().all():
                raise ExerciseFailed("rope_store_kv: not implemented yet: the kernel wrote neither q_out nor any cache "
                                     "slot (all still NaN, as these checks fill them). Fill in the kernel body.")
            others = torch.ones(num_blocks * block_size, dtype=torch.bool, device=k_cache.device)
            others[slots] = False
            for cache, before, what in ((flat_k, k_before, "K"), (flat_v, v_before, "V")):
                changed = ~(cache[others] == before.view_as(cache)[others]).view(-1, kv_heads * head_dim).all(dim=1)
                if changed.any():
                    bad = int(others.nonzero()[changed.nonzero()[0]].item())
                    raise ExerciseFailed(f"rope_store_kv wrote {what} into slot {bad}, which belongs to another token "
                                         f"(this step's slots are {slots.tolist()}). Token t's row goes to "
                                         "slots[t] * Hkv * D in the cache.")
            _check_output_written("rope_store_kv: q_out", q_out, _rope_reference(q64, cos64, sin64), where)
            _check_output_written("rope_store_kv: the K written to the cache", flat_k[slots], k64, where)
            _check_output_written("rope_store_kv: the V written to the cache", flat_v[slots], v64, where)
            _diagnose("rope_store_kv: q_out", q_out, _rope_reference(q64, cos64, sin64),
                      _rope_reference(q, cos, sin), lambda: _rope_mistakes(q64, cos64, sin64), where)
            _diagnose("rope_store_kv: the K in the cache", flat_k[slots], _rope_reference(k64, cos64, sin64),
                      _rope_reference(k, cos, sin),
                      lambda: _rope_mistakes(k64, cos64, sin64), where)
            rotated_v = _rope_reference(v64, cos64, sin64)
            _diagnose("rope_store_kv: the V in the cache", flat_v[slots], v64, v,
                      [("rotating V too gives: only Q and K carry positions; V is copied as it is", rotated_v)], where)
    print(f"rope_store_kv: q rotated, K rotated and V copied into their slots, every other slot untouched, on "
          f"{len(ROPE_STORE_KV_CASES)} shapes in {', '.join(str(d).removeprefix('torch.') for d in runtime.supported_dtypes())}")


def rope_store_kv_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, itemsize: int) -> dict[str, int]:
    """Bytes each version moves through memory for one call (every tensor read or written once; cos and sin
    counted once per token). Separate: apply_rope reads q, k, cos, sin and writes q_rot, k_rot; store_kv reads
    k_rot and v and writes both into the cache. Fused: q, k, v, cos, sin read once; q_rot and the cache rows
    written once. The difference is k_rot, written and read back."""
    q = tokens * heads * head_dim * itemsize
    kv = tokens * kv_heads * head_dim * itemsize
    angles = 2 * tokens * head_dim * itemsize
    apply_rope = (q + kv + angles) + (q + kv)
    store_kv = 2 * kv + 2 * kv
    fused = (q + 2 * kv + angles) + (q + 2 * kv)
    return {"apply_rope": apply_rope, "store_kv": store_kv, "separate": apply_rope + store_kv, "fused": fused}


# --- 4. A decode step made graph-safe (notebook 05) ---------------------------------------------------------------


def eager_decode_step(q, k_new, v_new, k_cache, v_cache, lengths):
    """One step of decode attention over a per-sequence KV cache of fixed capacity, written the eager way; it works,
    and a CUDA graph cannot capture it.

    q: (B, H, D), each sequence's new query; k_new, v_new: (B, Hkv, D), its new key and value; k_cache, v_cache:
    (B, Hkv, capacity, D); lengths: (B,) int64, tokens cached per sequence. Writes the new K, V at position
    lengths[b], attends over positions 0 ... lengths[b], advances lengths by one. Returns (B, H, D)."""
    outs = []
    for b in range(q.shape[0]):
        n = int(lengths[b])  # the CPU reads a value the GPU computed: a host sync
        k_cache[b, :, n] = k_new[b]
        v_cache[b, :, n] = v_new[b]
        k, v = k_cache[b:b + 1, :, : n + 1], v_cache[b:b + 1, :, : n + 1]  # a shape that changes every step
        outs.append(reference.attention(q[b:b + 1, :, None], k, v)[:, :, 0])
    lengths += 1
    return torch.cat(outs)  # a new tensor every call


def _op_signature(args, kwargs):
    """What a CUDA graph fixes about one op: the shapes, dtypes and devices of its tensors, and every other argument."""
    from torch.utils._pytree import tree_map

    def describe(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), str(a.dtype).removeprefix("torch."))
        return a if isinstance(a, (int, float, bool, str, type(None))) else repr(a)

    return tree_map(describe, (args, kwargs))


def _trace_ops(fn, *args):
    """Run ``fn(*args)``; return its result and the list of (op, signature) it dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Trace(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.ops.append((str(func), _op_signature(args, kwargs)))
            return func(*args, **kwargs)

    with Trace() as trace:
        result = fn(*args)
    return result, trace.ops


def _line_in(fn, traceback_) -> str:
    """The last line of ``fn``'s own source that the traceback passes through (where the student's step did it)."""
    import linecache
    import traceback

    code = getattr(fn, "__code__", None)
    lines = [frame for frame in traceback.extract_tb(traceback_) if code and frame.filename == code.co_filename]
    if not lines:
        return ""
    frame = lines[-1]
    text = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return f" (line {frame.lineno - code.co_firstlineno + 1} of your function: `{text}`)"


def _check_no_host_read(name: str, fn, args) -> None:
    """Run ``fn`` on fake tensors, which have shapes and dtypes but no values: any read of a value by Python (a host
    sync on a GPU: .item(), int(), bool(), .tolist(), a Python `if` on a tensor, a shape that depends on values),
    and any tensor built from Python data inside the step (a host-to-device copy on a GPU), is refused."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoHostData(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.lift_fresh.default:
                raise _HostData()
            return func(*args, **(kwargs or {}))

    mode = FakeTensorMode()
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    try:
        with mode, NoHostData():
            fn(*fake)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise ExerciseFailed(
            f"{name}: your step reads a tensor's value on the CPU{_line_in(fn, e.__traceback__)}. On a GPU that is a "
            "host sync: during capture no value is computed yet, and capture fails. Keep values on the device: "
            "index with the lengths tensor itself (advanced indexing, scatter, torch.where, a mask) instead of a "
            "Python int made from it.") from None
    except _HostData as e:
        raise ExerciseFailed(
            f"{name}: your step builds a tensor from Python data{_line_in(fn, e.__traceback__)} (torch.tensor(...)). "
            "On a GPU that is a copy from host memory, refused during capture: build it once, outside the step, or "
            "derive it on the device (torch.arange(..., device=...)).") from None
    except RuntimeError as e:
        if "numpy" in str(e):
            raise ExerciseFailed(f"{name}: your step reads a tensor's values on the CPU{_line_in(fn, e.__traceback__)}"
                                 " (.numpy()): a host sync on a GPU") from None
        raise


class _HostData(Exception):
    pass


GRAPH_SAFE_STEPS = 4  # steps checked: enough for every sequence's length and the cache's contents to move


def _graph_safe_problem(dtype, device):
    batch, heads, kv_heads, head_dim, capacity = 3, 4, 2, 16, 12
    # Ragged lengths; the longest stays inside the capacity for the GPU check's GRAPH_SAFE_STEPS + 2 steps (one eager,
    # then replays): a position past the capacity would be an out-of-bounds write on the device.
    lengths = torch.tensor([0, 5, capacity - GRAPH_SAFE_STEPS - 2], dtype=torch.int64, device=device)
    k_cache, v_cache = (torch.randn(batch, kv_heads, capacity, head_dim, device=device).to(dtype) for _ in range(2))
    new_inputs = [[torch.randn(shape, device=device).to(dtype)
                   for shape in ((batch, heads, head_dim), (batch, kv_heads, head_dim), (batch, kv_heads, head_dim))]
                  for _ in range(GRAPH_SAFE_STEPS + 3)]
    return k_cache, v_cache, lengths, new_inputs


def check_graph_safe_decode_step(fn) -> None:
    """``fn(q, k_new, v_new, k_cache, v_cache, lengths, out) -> out``: what :func:`eager_decode_step` computes, with
    the step's result written into the static tensor ``out``, and nothing a CUDA graph cannot capture.

    Everywhere: values against the eager step (float64 and the dtype's own) over several steps with ragged lengths;
    ``out`` returned, the same tensor each call; no value read by Python and no tensor built from Python data (run
    on fake tensors, which have no values); the same operations with the same shapes and arguments on every call
    (what a graph replays). On a GPU also: no synchronising CUDA call (torch.cuda.set_sync_debug_mode("error")),
    then the step captured into a CUDA graph and replayed step after step, each replay checked.
    Not proven on a CPU: that CUDA accepts the capture (an op whose GPU implementation syncs internally would pass
    here), and that a replay is faster."""
    device = runtime.device()
    for dtype in runtime.supported_dtypes():
        k_cache, v_cache, lengths, new_inputs = _graph_safe_problem(dtype, device)
        static = [t.clone() for t in new_inputs[0]]  # the step's input buffers, refreshed in place, as a graph's
        out = torch.empty_like(static[0]).fill_(float("nan"))
        eager = [k_cache.clone(), v_cache.clone(), lengths.clone()]  # the eager step's own state, in dtype
        eager64 = [k_cache.double(), v_cache.double(), lengths.clone()]  # and in float64: the truth
        state = (k_cache, v_cache, lengths, out)
        traces = []
        for step in range(GRAPH_SAFE_STEPS):
            for buffer, new in zip(static, new_inputs[step]):
                buffer.copy_(new)
            want_low = eager_decode_step(*new_inputs[step], *eager)
            want = eager_decode_step(*(t.double() for t in new_inputs[step]), *eager64)
            try:
                result, ops = _trace_ops(fn, *static, *state)
            except NotImplementedError as e:
                raise ExerciseFailed(f"graph_safe_decode_step: not implemented yet ({str(e) or 'NotImplementedError'}). "
                                     "Fill in the stub.") from None
            except Exception as e:
                raise ExerciseFailed(f"graph_safe_decode_step raised {type(e).__name__} at step {step + 1}"
                                     f"{_line_in(fn, e.__traceback__)}: {e}") from e
            if result is not out:
                raise ExerciseFailed(
                    "graph_safe_decode_step returned " + ("None" if result is None else "a new tensor") + ", not `out`. "
                    "A replayed graph writes its result at the address captured: write into out (out.copy_(...), or "
                    "an out= argument) and return out.")
            label = f"step {step + 1} of {GRAPH_SAFE_STEPS} (lengths before it: {(eager[2] - 1).tolist()}), {str(dtype).removeprefix('torch.')}"
            if not torch.equal(lengths, eager[2]):
                raise ExerciseFailed(f"graph_safe_decode_step: after {label}, lengths = {lengths.tolist()}, expected "
                                     f"{eager[2].tolist()}: advance it in place (lengths += 1), so the next replay sees it")
            for cache, want_cache, what in ((k_cache, eager[0], "k_cache"), (v_cache, eager[1], "v_cache")):
                if not torch.equal(cache, want_cache):
                    b, h, position, _ = (int(i) for i in (cache != want_cache).nonzero()[0])
                    raise ExerciseFailed(f"graph_safe_decode_step: after {label}, {what}[{b}, {h}, {position}] differs "
                                         "from the eager step's: the new K and V go to position lengths[b] of sequence b")
            try:
                check_close("graph_safe_decode_step", out, want, want_low)
            except AssertionError as e:
                raise ExerciseFailed(f"{e}\n  after {label}. Each sequence sees positions 0 ... lengths[b] (the new "
                                     "token included), no more.") from None
            if step == 0:
                _check_no_host_read("graph_safe_decode_step", fn, (*static, *state))
            traces.append(ops)
            if ops != traces[0]:
                index = next((i for i, (a, b) in enumerate(zip(traces[0], ops)) if a != b), min(len(ops), len(traces[0])))
                first = traces[0][index][0] if index < len(traces[0]) else "nothing"
                now = ops[index][0] if index < len(ops) else "nothing"
                raise ExerciseFailed(
                    f"graph_safe_decode_step: step {step + 1} ran other operations than step 1 (op #{index + 1}: "
                    f"{now} where step 1 ran {first}, {len(ops)} ops against {len(traces[0])}). A graph replays step "
                    "1's operations, with step 1's shapes and arguments, forever. Keep every shape and Python value "
                    "the same each step; let only tensor contents (lengths) change.")
        if runtime.on_gpu():
            _check_capture(fn, dtype)
    where = (", captured and replayed as a CUDA graph" if runtime.on_gpu() else
             " (capture itself needs a GPU: run this on one for the full check)")
    print(f"graph_safe_decode_step: right values over {GRAPH_SAFE_STEPS} steps with ragged lengths, out reused, no host "
          f"read, the same ops and shapes every step{where}")


def _check_capture(fn, dtype) -> None:
    """On a GPU: no synchronising call, then capture one step and replay it step after step against the eager step."""
    device = runtime.device()
    k_cache, v_cache, lengths, new_inputs = _graph_safe_problem(dtype, device)
    static = [t.clone() for t in new_inputs[0]]
    out = torch.empty_like(static[0])
    eager = [k_cache.clone(), v_cache.clone(), lengths.clone()]
    eager64 = [k_cache.double(), v_cache.double(), lengths.clone()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(*static, k_cache, v_cache, lengths, out)  # step 1, eager, on the side of the capture: must not sync
    except RuntimeError as e:
        raise ExerciseFailed(f"graph_safe_decode_step: a synchronising CUDA call{_line_in(fn, e.__traceback__)}: "
                             f"{str(e).splitlines()[0]}") from None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager_decode_step(*new_inputs[0], *eager)
    eager_decode_step(*(t.double() for t in new_inputs[0]), *eager64)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(graph):  # capture records step 2 without running it
            fn(*static, k_cache, v_cache, lengths, out)
    except RuntimeError as e:
        raise ExerciseFailed(f"graph_safe_decode_step: CUDA refused to capture the step{_line_in(fn, e.__traceback__)}: "
                             f"{str(e).splitlines()[0]}") from None
    for step in range(1, GRAPH_SAFE_STEPS + 2):
        for buffer, new in zip(static, new_inputs[step]):
            buffer.copy_(new)
        graph.replay()
        want_low = eager_decode_step(*new_inputs[step], *eager)
        want = eager_decode_step(*(t.double() for t in new_inputs[step]), *eager64)
        torch.cuda.synchronize()
        if not (torch.equal(lengths, eager[2]) and torch.equal(k_cache, eager[0]) and torch.equal(v_cache, eager[1])):
            raise ExerciseFailed(f"graph_safe_decode_step: replay {step} left lengths or the caches different from the "
                                 "eager step's")
        try:
            check_close("graph_safe_decode_step (replayed)", out, want, want_low)
        except AssertionError as e:
            raise ExerciseFailed(f"{e}\n  at replay {step} of the captured graph") from None


def check_fused_backward() -> None:
    """The gradients of lessonlib's fused ops (swiglu, add_rms_norm, apply_rope), through autograd and their Triton
    backward kernels, against float64 autograd through the reference: odd shapes, every supported dtype, gradients
    poisoned (NaN) until the backward kernels write them. Raises AssertionError with the worst element otherwise."""
    from lessonlib import ops
    from lessonlib.testing import check_gradients

    for dtype in runtime.supported_dtypes():
        for shape in SWIGLU_SHAPES:
            gate, up = _inputs(shape, shape, dtype=dtype)
            check_gradients("swiglu", ops.swiglu, reference.swiglu, (gate, up), ("gate", "up"))
        for shape in ADD_RMS_NORM_SHAPES:
            x, residual, weight = _inputs(shape, shape, shape[-1:], dtype=dtype)
            check_gradients("add_rms_norm", ops.add_rms_norm, reference.add_rms_norm, (x, residual, weight, 1e-6),
                            ("x", "residual", "weight", None))
        q, k = _inputs((2, 4, 7, 64), (2, 2, 7, 64), dtype=dtype)
        cos, sin = reference.rope_cos_sin(torch.arange(7, device=runtime.device()), 64, dtype=dtype)
        check_gradients("apply_rope", ops.apply_rope, reference.apply_rope, (q, k, cos, sin), ("q", "k", None, None))
    print("✓ gradients of swiglu, add_rms_norm and apply_rope match float64 autograd (odd shapes x every supported dtype)")
