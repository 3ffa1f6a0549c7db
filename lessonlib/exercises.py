"""Checkers for the exercises. Each takes the student's function, runs it on fresh random inputs of several odd
shapes and every dtype this mode supports, with outputs poisoned (NaN) first, and either prints one line of success
or raises :class:`ExerciseFailed` with a message that says what to fix.

The notebooks also run these checkers on lessonlib's own kernels, so a broken library kernel fails a notebook loudly.
"""

from __future__ import annotations

import torch

from lessonlib import reference, runtime
from lessonlib.testing import check_close, poisoned_outputs, to_float64


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
        raise ExerciseFailed(f"{name}: not implemented yet ({e or 'NotImplementedError'}). Fill in the stub.") from None
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

    llm = serving.shared_engine()
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    rng = random.Random()
    cases = [(block_size, 1), (block_size, 2), (block_size - 1, 2), (1, 1), (1, block_size)]
    cases += [(rng.randrange(1, 4 * block_size), rng.randrange(1, 3 * block_size)) for _ in range(3)]
    prompts = [[rng.randrange(10, 400) for _ in range(prompt_tokens)] for prompt_tokens, _ in cases]
    for (prompt_tokens, max_tokens), prompt in zip(cases, prompts):
        try:
            predicted = fn(prompt_tokens, max_tokens, block_size)
        except NotImplementedError as e:
            raise ExerciseFailed(f"blocks_needed: not implemented yet ({e or 'NotImplementedError'}). Fill in the stub.") from None
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
                raise ExerciseFailed(f"online_softmax_update: not implemented yet ({e or 'NotImplementedError'}). "
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
            raise ExerciseFailed(f"key_tile_bound: not implemented yet ({e or 'NotImplementedError'}). Fill in the stub.") from None
        if got != want:
            raise ExerciseFailed(
                f"key_tile_bound(start_m={start_m}, block_m={block_m}, n_q={n_q}, n_kv={n_kv}) = {got}, expected "
                f"{want}. The tile's last real query is min(start_m + block_m, n_q) - 1; it sees keys up to that "
                "+ (n_kv - n_q); clamp to [0, n_kv].")
    print(f"key_tile_bound: correct on {len(cases)} tiles (including Nq > Nkv and partial last tiles)")


def check_flash_attention(fn) -> None:
    """``fn(q, k, v, causal=...)``: attention as ``lessonlib.reference.attention``, forward and backward, on odd
    lengths, GQA and both masks, outputs poisoned first; within the tolerance rule of lessonlib.testing."""
    from lessonlib.ops.flash_attention import supported_dtypes
    from lessonlib.testing import check_attention

    for dtype in supported_dtypes():
        for (batch, heads, kv_heads, n_q, n_kv, head_dim, causal) in ((1, 2, 2, 17, 17, 32, True),
                                                                     (2, 4, 1, 9, 40, 16, True),
                                                                     (1, 4, 2, 33, 20, 64, False)):
            q, k, v = _inputs((batch, heads, n_q, head_dim), (batch, kv_heads, n_kv, head_dim),
                              (batch, kv_heads, n_kv, head_dim), dtype=dtype)
            try:
                check_attention(fn, q, k, v, causal)
            except NotImplementedError as e:
                raise ExerciseFailed(f"flash_attention: not implemented yet ({e or 'NotImplementedError'})") from None
            except AssertionError as e:
                raise ExerciseFailed(f"{e}\n  on q {tuple(q.shape)}, k/v {tuple(k.shape)}, {dtype}, causal={causal}") from None
    print("flash_attention: forward and backward within tolerance on odd lengths, GQA, causal and full, "
          f"{', '.join(str(d).removeprefix('torch.') for d in supported_dtypes())}")


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
            raise ExerciseFailed(f"physical_slot: not implemented yet ({e or 'NotImplementedError'}). Fill in the stub.") from None
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
            raise ExerciseFailed(f"free_sequence: not implemented yet ({e or 'NotImplementedError'}). Fill in the stub.") from None
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
            raise ExerciseFailed(f"no_graph_break: not implemented yet ({e or 'NotImplementedError'}). Fill in the stub.") from None
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
            raise ExerciseFailed(f"refresh_static_inputs: not implemented yet ({e or 'NotImplementedError'}). "
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
