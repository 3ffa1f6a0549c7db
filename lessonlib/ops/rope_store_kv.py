"""rope_store_kv: RoPE on the new tokens' q and k, and the KV-cache write, in one kernel.

Per layer and step a decoder splits the fused projection's output ``qkv`` (T, (H + 2 Hkv) D) into q, k and v,
rotates q and k, and writes k and v into their paged-cache slots. Done separately that is four launches: copies of
q and k to contiguous rows, ``apply_rope``, then ``store_kv``. Here one program per token reads its qkv row and its
cos/sin row once, writes q rotated into a new contiguous (T, H, D) tensor, k rotated straight into ``k_cache`` at
``slots[t]`` and v copied into ``v_cache`` at the same slot.

Bytes per token (q = H D, kv = Hkv D, in elements; ``traffic.rope_store_kv`` counts them): the separate chain
copies q and k (read and write: 2 q + 2 kv), rotates them (reads q, k, cos, sin, writes q_rot, k_rot) and stores
(reads k_rot and v, writes both); fused, k_rot never goes to memory and the copies vanish: 2 q + 4 kv fewer bytes,
half of the chain's (H=32, Hkv=8, D=128 in 16 bits: 24 KB of 48.5 KB per token), and 3 launches fewer per layer.

The rotation is ``apply_rope``'s own code (``_rotate_heads``, float32 arithmetic, one rounding on the store), so
q and the cache hold the same bits as ``apply_rope`` then ``store_kv`` (tests/ops/test_rope_store_kv.py checks it).

``rope_store_kv`` is the op a model calls: the custom op ``torch.ops.lessonlib.rope_store_kv`` (mutating k_cache
and v_cache, with a fake implementation) under torch.compile, the launcher directly otherwise. No backward: inputs
that require grad are refused (outside ``torch.no_grad()``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib.ops._common import (check_tensors, launch, pdl_options, pdl_wait_then_trigger,
                                   refuse_gradient)
from lessonlib.ops.apply_rope import apply_rope
from lessonlib.ops.apply_rope import _rotate_heads  # the same rotation code: the same bits as apply_rope
from lessonlib.ops.apply_rope import config as rope_config
from lessonlib.ops.store_kv import check_slot_values, check_slots, store_kv
from lessonlib.ops.store_kv import config as copy_config


@triton.jit
def _rope_store_kv_kernel(
    qkv_ptr,  # (T, (H + 2 * Hkv) * D): token rows stride_qkv_t apart, each row contiguous: q heads, k heads, v heads
    cos_ptr, sin_ptr,  # (T, D): token rows stride_cos_t / stride_sin_t apart
    slots_ptr,  # (T,) int64 or int32: the cache slot of each token
    q_out_ptr,  # (T, H, D) contiguous
    k_cache_ptr, v_cache_ptr,  # (num_slots, Hkv * D) contiguous: (num_blocks, block_size, Hkv, D)
    stride_qkv_t,
    stride_cos_t,
    stride_sin_t,
    n_q_heads, n_kv_heads, half,  # half = D // 2
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,  # apply_rope's tiles
    BLOCK_V: tl.constexpr,  # store_kv's BLOCK: elements of v's row copied per step
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (ops._common.pdl_options)
):
    # One program per token: it reads the token's cos/sin row and slot once for all its heads. A token moves
    # (2 H + 4 Hkv) D + 2 D elements, 24.5 KB at H=32, Hkv=8, D=128 in 16 bits: at decode (T <= 64) a call moves
    # at most 1.6 MB, a few DRAM round trips' worth (q's heads, then k's, then v's), so its time is latency, and
    # the three launches it removes per layer weigh more than the idle SMs. Programs per (token, head group) would
    # run q's, k's and v's phases side by side at T = 1 but reload cos/sin and the slot in each: the next version
    # to try if the benchmark's decode rows (graph_us against the copy of the same bytes) show it. At prefill
    # (T = 4096) the tokens alone fill the GPU.
    pdl_wait_then_trigger(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    head_dim = 2 * half
    row = n_kv_heads * head_dim  # one token's K (or V) row in the cache
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    cos_row = cos_ptr + token * stride_cos_t
    sin_row = sin_ptr + token * stride_sin_t
    cos1 = tl.load(cos_row + d, mask=dmask).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + half + d, mask=dmask).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + d, mask=dmask).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + half + d, mask=dmask).to(tl.float32)[None, :]
    q_row = qkv_ptr + token * stride_qkv_t
    k_row = q_row + n_q_heads * head_dim
    v_row = k_row + row
    _rotate_heads(q_row, q_out_ptr + token * n_q_heads * head_dim, n_q_heads, head_dim, head_dim, half,
                  cos1, cos2, sin1, sin2, BLOCK_HQ, BLOCK_D, False)
    _rotate_heads(k_row, k_cache_ptr + slot * row, n_kv_heads, head_dim, head_dim, half,
                  cos1, cos2, sin1, sin2, BLOCK_HK, BLOCK_D, False)
    for start in range(0, row, BLOCK_V):  # v: a copy, as store_kv does it
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < row
        tl.store(v_cache_ptr + slot * row + cols, tl.load(v_row + cols, mask=mask), mask=mask)


def check_heads_and_caches(op: str, k_cache, v_cache, num_heads, num_kv_heads) -> int:
    """The head counts and the paged caches of an op that writes K/V (this one, ops.decode_qkv_rope_store_kv);
    returns head_dim."""
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{op}: {name} must be a positive int, got {n!r}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"{op}: caches must be (num_blocks, block_size, {num_kv_heads}, head_dim) and "
                         f"alike, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: k_cache and v_cache must be contiguous")
    head_dim = k_cache.shape[3]
    if head_dim % 2:
        raise ValueError(f"{op}: head_dim must be even (rotate_half splits it in two halves), got {head_dim}")
    return head_dim


def _check(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads) -> None:
    """Every check that reads no tensor's values (the fake implementation runs these too)."""
    check_tensors("rope_store_kv", qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    head_dim = check_heads_and_caches("rope_store_kv", k_cache, v_cache, num_heads, num_kv_heads)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"rope_store_kv: qkv must be (T, (num_heads + 2 * num_kv_heads) * head_dim) = (T, "
                         f"({num_heads} + 2 * {num_kv_heads}) * {head_dim}) = (T, {width}), got {tuple(qkv.shape)}")
    tokens = qkv.shape[0]
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (tokens, head_dim):
            raise ValueError(f"rope_store_kv: {name} must be (T, head_dim) = ({tokens}, {head_dim}), got "
                             f"{tuple(table.shape)}")
    check_slots("rope_store_kv", slots, tokens, qkv.device)


def config(num_heads: int, num_kv_heads: int, head_dim: int, profile=None) -> dict:
    """apply_rope's tiles for the rotation and store_kv's BLOCK for v's copy, at their warps: the same on every GPU,
    ``profile`` accepted for a uniform interface. Registers only, no shared memory (compiled for sm_75 to sm_90:
    tests/ops/test_compile_targets.py)."""
    rope = rope_config(num_heads, num_kv_heads, head_dim)
    copy = copy_config(num_kv_heads * head_dim)
    return dict(rope, BLOCK_V=copy["BLOCK"], num_warps=max(rope["num_warps"], copy["num_warps"]))


def rope_store_kv_forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                          validate: bool = True) -> torch.Tensor:
    """The launcher (models call :func:`rope_store_kv`, same arguments)."""
    _check(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads)
    tokens, head_dim = qkv.shape[0], k_cache.shape[3]
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if validate:  # reads slots on the host: a sync, so not under CUDA-graph capture (validate=False there)
        check_slot_values("rope_store_kv", slots, k_cache.shape[0] * k_cache.shape[1])
    if tokens == 0:
        return q_out
    launch(_rope_store_kv_kernel, (tokens,), qkv, cos, sin, slots, q_out, k_cache, v_cache,
           qkv.stride(0), cos.stride(0), sin.stride(0), num_heads, num_kv_heads, head_dim // 2,
           **config(num_heads, num_kv_heads, head_dim), **pdl_options())
    return q_out


# --- the op: torch.ops.lessonlib.rope_store_kv, writing into the caches, returning q rotated, no gradient --------

@torch.library.custom_op("lessonlib::rope_store_kv", mutates_args=("k_cache", "v_cache"))
def _rope_store_kv_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                      validate: bool) -> torch.Tensor:
    return rope_store_kv_forward(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, validate)


@_rope_store_kv_op.register_fake
def _(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, validate):
    _check(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads)  # slot values: at run time only
    return qkv.new_empty((qkv.shape[0], num_heads, k_cache.shape[3]))


_ROPE_STORE_KV = torch.ops.lessonlib.rope_store_kv.default


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                  validate: bool = True) -> torch.Tensor:
    """Rotate the new tokens' q (returned) and k (written into k_cache), copy v into v_cache, in one launch.

    qkv: (T, (num_heads + 2 * num_kv_heads) * head_dim), q's columns then k's then v's (a fused projection's
    output; rows may be strided, each row contiguous); cos, sin: (T, head_dim) (``reference.rope_cos_sin``);
    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim), contiguous; slots: (T,) integer, distinct,
    each below num_blocks * block_size. Returns q rotated, a new contiguous (T, num_heads, head_dim) tensor, with
    the bits ``apply_rope`` gives; the caches hold what ``apply_rope`` then ``store_kv`` would write.

    ``validate=False`` skips the range and distinctness checks of ``slots`` (a device sync and a sort per call),
    as ``store_kv``'s does: only for slots from a trusted source. Shapes, dtypes and devices are always checked,
    before the launch. No backward: inputs that require grad are refused (outside ``torch.no_grad()``)."""
    refuse_gradient("rope_store_kv", "it writes K and V into the cache in place and has no backward",
                    qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    if torch.compiler.is_compiling():
        return _ROPE_STORE_KV(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, validate)
    return rope_store_kv_forward(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, validate)


def apply_rope_then_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slots: torch.Tensor, *, num_heads: int,
                             num_kv_heads: int) -> torch.Tensor:
    """The separate kernels this op replaces, as the serving engine ran them (four launches): copies of q and k
    out of qkv's rows, apply_rope, store_kv. Same arguments and result as :func:`rope_store_kv` with
    ``validate=False``; the tests compare the two bit for bit, the benchmark times both."""
    tokens, head_dim = qkv.shape[0], k_cache.shape[3]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.contiguous().view(tokens, num_heads, head_dim)  # apply_rope's outputs keep its inputs' layout, and
    k = k.contiguous().view(tokens, num_kv_heads, head_dim)  # store_kv needs each token's k row contiguous
    q, k = apply_rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)  # the tokens as one batch row
    store_kv(k[0].transpose(0, 1), v.view(tokens, num_kv_heads, head_dim), k_cache, v_cache, slots, validate=False)
    return q[0].transpose(0, 1)
