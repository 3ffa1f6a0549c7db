"""Lesson 02's checkers (notebook 02_flash_attention): the online-softmax update, the causal key-tile bound,
attention, and the FlashAttention forward kernel the student writes (kernel exercise 1).
"""

from __future__ import annotations

import warnings

import torch

from lessonlib import reference, runtime
from lessonlib.exercises._checking import (ExerciseFailed, _call, _diagnose, _inputs, _not_implemented_output,
                                           _require_kernel, passed)
from lessonlib.exercises._guards import Guards, launch_guards, launch_kernel, output_like
from lessonlib.testing import attention_allowance, check_close, to_float64


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
    passed("online_softmax_update: correct on 4 problems (float64, exact to rounding), including a late large score")


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
    passed(f"key_tile_bound: correct on {len(cases)} tiles (including Nq > Nkv and partial last tiles)")


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
    passed("flash_attention: forward and backward within tolerance on odd lengths, GQA, causal and full, "
          f"{', '.join(str(d).removeprefix('torch.') for d in flash_attention_dtypes())}")


# --- 1. The FlashAttention forward kernel (notebook 02) ----------------------------------------------------------


def flash_forward_config() -> dict:
    """Tiles for the exercise kernel: 16 x 16 in the interpreter (cheap steps, and shapes of 45 or 100 keys span
    several tiles); 32 x 32 on a GPU, still several tiles on the checker's shapes (the rescale must be exercised)."""
    if runtime.on_gpu():
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4)
    return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)


def flash_forward(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  config: dict | None = None, guards: Guards | None = None) -> torch.Tensor:
    """Launch the exercise's forward kernel: one program per (query tile, batch x head), as
    lessonlib's kernel.

    q: (B, H, Nq, D); k, v: (B, Hkv, Nkv, D); H a multiple of Hkv, D in {16, 32, 64, 128}. Inputs
    are made contiguous, so row n of head (b, h) starts at ((b * H + h) * N + n) * D. Returns out
    like q. ``guards``: the checker's (:mod:`~lessonlib.exercises._guards`)."""
    import triton

    from lessonlib.ops.flash_attention import check_inputs

    check_inputs(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, heads, n_q, head_dim = q.shape
    config = config or flash_forward_config()
    grid = (triton.cdiv(n_q, config["BLOCK_M"]), batch * heads)
    with launch_guards("flash_forward", guards) as guards:
        out = output_like(guards, "out", q)
        launch_kernel(guards, "flash_forward", kernel, grid, q, k, v, out, n_q, k.shape[2],
                      head_dim ** -0.5, GROUP=heads // k.shape[1], CAUSAL=bool(causal),
                      HEAD_DIM=head_dim, **config)
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
    FlashAttention kernels take here, outputs poisoned, every tensor in guard zones (a missing mask is named); a
    wrong answer is matched against known mistakes. Then causal tile skipping (:func:`_check_causal_tiles_skipped`)."""
    from lessonlib.ops.flash_attention import flash_attention_dtypes

    _require_kernel("flash_forward", kernel, "my_flash_forward_kernel")
    block_n = flash_forward_config()["BLOCK_N"]
    for dtype in flash_attention_dtypes():
        for batch, heads, kv_heads, n_q, n_kv, head_dim, causal in FLASH_FORWARD_CASES:
            q, k, v = _inputs((batch, heads, n_q, head_dim), (batch, kv_heads, n_kv, head_dim),
                              (batch, kv_heads, n_kv, head_dim), dtype=dtype)
            where = (f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, {str(dtype).removeprefix('torch.')}, "
                     f"causal={causal}")
            guards = Guards("flash_forward")
            q, k, v = (guards.place(name, t) for name, t in (("q", q), ("k", k), ("v", v)))
            out = guards.run(lambda: _call("flash_forward", lambda *a: flash_forward(kernel, *a, causal=causal,
                                                                                     guards=guards), (q, k, v)))
            with guards.judged():
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
    _check_causal_tiles_skipped(kernel)
    passed(f"flash_forward: your kernel matches float64 attention on {len(FLASH_FORWARD_CASES)} shapes (N = 1, 7, 45, "
          "100; GQA, MQA; causal with Nq < Nkv and Nq > Nkv) in "
          f"{', '.join(str(d).removeprefix('torch.') for d in flash_attention_dtypes())}"
          f"{' on the GPU' if runtime.on_gpu() else ' (Triton interpreter)'}")


def _check_causal_tiles_skipped(kernel) -> None:
    """With CAUSAL, no program may visit a key tile above the diagonal: a tile whose first key none of the program's
    queries can see (the loop stops at ``key_tile_bound``, exercise 2). In the interpreter the launch's loads are
    recorded: every tile a program loaded K or V from (masked lanes included: the loop still ran) is counted. On a
    GPU, where nothing is recorded, those keys' K and V are NaN instead: a kernel that visits them and only masks the
    scores multiplies NaN by p = 0 and NaN reaches the first query tile's output (NaN * 0 is NaN)."""
    config = flash_forward_config()
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    n_q = n_kv = 4 * block_m + 5  # several query tiles; the first sees keys 0 .. BLOCK_M - 1 only
    from lessonlib.ops.flash_attention import flash_attention_dtypes

    # The first dtype the checks above use (float32 here; on a GPU float16: a float32 tl.dot runs in TF32 there).
    q, k, v = _inputs((1, 2, n_q, 16), (1, 1, n_kv, 16), (1, 1, n_kv, 16), dtype=flash_attention_dtypes()[0])
    if runtime.on_gpu():
        return _causal_tiles_skipped_on_gpu(kernel, q, k, v, block_m, block_n)
    guards = Guards("flash_forward")
    _call("flash_forward", lambda *a: flash_forward(kernel, *a, causal=True, guards=guards), (q, k, v))
    obs = guards.observations[-1]
    above = []
    for name in ("k", "v"):
        for program, offset in obs.tensors[name].visited.tolist():
            tile_m, _, _ = obs.programs[program]
            last_row = min((tile_m + 1) * block_m, n_q) - 1
            key = (offset // 16) % n_kv
            if (key // block_n) * block_n > last_row + n_kv - n_q:
                above.append((program, key // block_n, tile_m, last_row, key))
    if above:
        program, tile, tile_m, last_row, _ = min(above)
        keys = [a[4] for a in above if a[0] == program]
        raise ExerciseFailed(
            f"flash_forward: with CAUSAL your kernel visited {len({a[:2] for a in above})} key tiles above the "
            f"diagonal (Nq = Nkv = {n_q}, BLOCK_M = {block_m}, BLOCK_N = {block_n}): program {tuple(obs.programs[program][:2])}, "
            f"queries {tile_m * block_m}..{last_row}, loaded K or V of keys {min(keys)}..{max(keys)}, which none of its "
            "queries can see. Masking them (the scores, V's load mask, or tl.where on V) gives the right values "
            "but does all the work; stop the loop at hi = min(start_m + BLOCK_M, Nq) + Nkv - Nq (exercise 2).")


def _causal_tiles_skipped_on_gpu(kernel, q, k, v, block_m: int, block_n: int) -> None:
    n_q, n_kv = q.shape[2], k.shape[2]
    first_skipped = -(-block_m // block_n) * block_n  # the first key tile past the first query tile's bound
    truth = reference.attention(*to_float64(q, k, v), causal=True)[:, :, :block_m]
    low = reference.attention(q, k, v, causal=True)[:, :, :block_m]
    allowance = attention_allowance(q, k, v)
    k[:, :, first_skipped:], v[:, :, first_skipped:] = float("nan"), float("nan")
    guards = Guards("flash_forward")
    q, k, v = (guards.place(name, t) for name, t in (("q", q), ("k", k), ("v", v)))
    with warnings.catch_warnings():  # the later tiles' max over NaN scores: expected here, not the student's to see
        warnings.simplefilter("ignore", RuntimeWarning)
        out = _call("flash_forward", lambda *a: flash_forward(kernel, *a, causal=True, guards=guards), (q, k, v))
    guards.check_writes()
    first_tile = out[:, :, :block_m]
    if first_tile.isnan().any():
        raise ExerciseFailed(
            f"flash_forward: with CAUSAL your kernel does not skip the key tiles above the diagonal: the first "
            f"query tile (queries 0..{block_m - 1} of {n_q}) loaded keys {first_skipped}..{n_kv - 1}, which none of "
            "its queries can see (they were set to NaN, and NaN reached its output). Masking them gives the right "
            "values but does all the work; stop the loop at hi = min(start_m + BLOCK_M, Nq) + Nkv - Nq (exercise 2).")
    try:  # the tolerance rule of lessonlib.testing, as for every output above
        check_close("flash_forward", first_tile, truth, low, allowance=allowance)
    except AssertionError as e:
        raise ExerciseFailed(f"{e}\n  with CAUSAL, on the first query tile when only keys it cannot see changed: "
                             f"its output must depend on keys 0..{block_m - 1} alone") from None
