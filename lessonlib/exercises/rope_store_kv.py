"""Lesson 03's kernel exercise 3 (notebook 03_paged_attention): a RoPE kernel, then RoPE fused with the KV-cache
write, and the bytes each moves.
"""

from __future__ import annotations

import torch

from lessonlib import reference, runtime
from lessonlib.exercises._checking import ExerciseFailed, _call, _diagnose, _inputs, _require_kernel, passed
from lessonlib.exercises._guards import Guards, launch_guards, launch_kernel, output_like
from lessonlib.testing import to_float64


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


def rope(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, guards: Guards | None = None) -> torch.Tensor:
    """Launch the exercise's RoPE kernel, one program per token. x: (T, H, D), D even, the new tokens' queries or
    keys as a projection returns them; cos, sin: (T, D), each token's angles (``reference.rope_cos_sin``).
    Returns x rotated, (T, H, D), as ``reference.apply_rope`` rotates it. ``guards``: the checker's
    (:mod:`~lessonlib.exercises._guards`)."""
    _check_rope_args("rope", x, cos, sin)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    sizes = _rope_launch_sizes(x.shape[1], x.shape[2])
    with launch_guards("rope", guards) as guards:
        out = output_like(guards, "out", x)
        if x.numel():
            launch_kernel(guards, "rope", kernel, (x.shape[0],), x, cos, sin, out, x.shape[1], **sizes,
                   num_warps=1 if not runtime.on_gpu() else 4)
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


# (tokens, heads, head_dim): D/2 of 40 and 3 not powers of 2. The one-pair case last: a wrong kernel is named on a
# case of many elements, where no two known mistakes give the same values (at head_dim 2 two can, in ~1% of draws).
ROPE_CASES = ((7, 3, 64), (33, 8, 80), (5, 2, 6), (1, 1, 2))


def _rope_inputs(tokens, heads, head_dim, dtype):
    (x,) = _inputs((tokens, heads, head_dim), dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), device=runtime.device())
    cos, sin = reference.rope_cos_sin(positions, head_dim, dtype=dtype)
    return x, cos, sin


def check_rope_kernel(kernel) -> None:
    """``kernel``: the exercise's @triton.jit RoPE kernel, launched by :func:`rope`. Checked against
    ``reference.apply_rope`` in float64 on 1 to 33 tokens, 1 to 8 heads, head_dim 2 to 80 (half not a power of
    two), random positions up to 4096, every supported dtype, outputs poisoned, every tensor in guard zones (a
    missing mask is named)."""
    _require_kernel("rope", kernel, "my_rope_kernel")
    for dtype in runtime.supported_dtypes():
        for tokens, heads, head_dim in ROPE_CASES:
            guards = Guards("rope", "store its token's heads rotated: x * cos + rotate_half(x) * sin")
            x, cos, sin = (guards.place(name, t) for name, t in
                           zip(("x", "cos", "sin"), _rope_inputs(tokens, heads, head_dim, dtype)))
            where = f"x {tuple(x.shape)}, {str(dtype).removeprefix('torch.')}"
            out = guards.run(lambda: _call("rope", lambda *a: rope(kernel, *a, guards=guards), (x, cos, sin)))
            with guards.judged():
                truth = _rope_reference(*to_float64(x, cos, sin))
                _check_output_written("rope", out, truth, where)
                cpu64 = [t.cpu() for t in to_float64(x, cos, sin)]
                _diagnose("rope", out, truth, _rope_reference(x, cos, sin), lambda: _rope_mistakes(*cpu64), where)
    passed(f"rope: your kernel matches reference.apply_rope on {len(ROPE_CASES)} shapes (head_dim 2 to 80) in "
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
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  guards: Guards | None = None) -> torch.Tensor:
    """Launch the exercise's fused kernel, one program per new token: rotate q (returned) and k, and write k and v
    straight into their cache slots. q: (T, H, D); k, v: (T, Hkv, D); cos, sin: (T, D); caches (num_blocks,
    block_size, Hkv, D) contiguous; slots: (T,) int64, distinct, inside the pool (checked, as store_kv checks)."""
    from lessonlib.ops._common import check_tensors, next_power_of_2

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
    sizes = _rope_launch_sizes(q.shape[1], q.shape[2])
    with launch_guards("rope_store_kv", guards) as guards:
        q_out = output_like(guards, "q_out", q)
        launch_kernel(guards, "rope_store_kv", kernel, (q.shape[0],), q, k, v, cos, sin, slots, q_out, k_cache, v_cache, q.shape[1], k.shape[1],
               HALF=sizes["HALF"], BLOCK_HQ=sizes["BLOCK_H"], BLOCK_HKV=next_power_of_2(k.shape[1]),
               BLOCK_HALF=sizes["BLOCK_HALF"], num_warps=1 if not runtime.on_gpu() else 4)
    return q_out


# (tokens, H, Hkv, D, block_size); the one-pair case last, as in ROPE_CASES.
ROPE_STORE_KV_CASES = ((7, 4, 2, 64, 4), (13, 8, 1, 80, 16), (1, 1, 1, 2, 4))


def check_rope_store_kv_kernel(kernel) -> None:
    """``kernel``: the exercise's fused RoPE + cache-write kernel, launched by :func:`rope_store_kv`. Checked
    against ``reference.apply_rope`` followed by the cache write ``store_kv`` does (vLLM's reshape_and_cache): the
    rotated q returned, rotated k and plain v in each token's slot (poisoned with NaN before the call), and every
    other slot of the pool unchanged, bit for bit; every tensor in guard zones (a missing mask is named)."""
    _require_kernel("rope_store_kv", kernel, "my_rope_store_kv_kernel")
    for dtype in runtime.supported_dtypes():
        for tokens, heads, kv_heads, head_dim, block_size in ROPE_STORE_KV_CASES:
            q, cos, sin = _rope_inputs(tokens, heads, head_dim, dtype)
            k, v = _inputs((tokens, kv_heads, head_dim), (tokens, kv_heads, head_dim), dtype=dtype)
            num_blocks = -(-tokens // block_size) + 2
            k_cache, v_cache = _inputs(*[(num_blocks, block_size, kv_heads, head_dim)] * 2, dtype=dtype)
            slots = torch.randperm(num_blocks * block_size, device=runtime.device())[:tokens]
            guards = Guards("rope_store_kv", "store its token's q rotated into q_out, and its k rotated and v as it is into the token's cache slot")
            q, k, v, cos, sin, k_cache, v_cache, slots = (
                guards.place(name, t) for name, t in zip(("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slots"),
                                                         (q, k, v, cos, sin, k_cache, v_cache, slots)))
            flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
            flat_k[slots], flat_v[slots] = float("nan"), float("nan")  # what the kernel must overwrite
            k_before, v_before = k_cache.clone(), v_cache.clone()
            where = f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, slots {slots.tolist()}, {str(dtype).removeprefix('torch.')}"
            q_out = guards.run(lambda: _call("rope_store_kv", lambda *a: rope_store_kv(kernel, *a, guards=guards),
                                             (q, k, v, cos, sin, k_cache, v_cache, slots)),
                               lambda q_out: (q_out, flat_k[slots], flat_v[slots]))
            with guards.judged():
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
    passed(f"rope_store_kv: q rotated, K rotated and V copied into their slots, every other slot untouched, on "
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
