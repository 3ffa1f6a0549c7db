"""decode_gemv: ops.gemv with the work around it folded in, so a batch-1 decode layer takes six kernels, not nine.

At batch 1 a decode step is bound by its kernel count, not by any one kernel: each projection reads its weights at
about 1 TB/s with a fixed 7-8 us around it (benchmarks/decisions/gemv-with-pdl.md). Today's layer: add_rms_norm, qkv gemv,
rope_store_kv, paged attention (split + reduce), o gemv, add_rms_norm, gate_up gemv (SwiGLU epilogue), down gemv.
Here the norms, the RoPE and the K/V write and the residual adds ride in the projections' prologues and epilogues::

    K1  qkv      RMSNorm prologue, RoPE + K/V-cache write epilogue     (decode_qkv_rope_store_kv)
    K2  paged attention, split + reduce, as before
    K4  o        residual-add epilogue: stream += attn @ Wo^T           (decode_gemv(..., residual=stream))
    K5  gate_up  RMSNorm prologue, SwiGLU epilogue                      (decode_gemv(..., norm_weight=...))
    K6  down     residual-add epilogue                                   (decode_gemv(..., residual=stream))

The residual stream is one (M, hidden) tensor updated in place by K4 and K6, and read whole by the next K1/K5.

**Prologue.** Each program walks the whole row of x anyway; with ``norm_weight`` it first takes the row's sum of
squares (no extra read when K fits one tile: the first tile is kept), then multiplies each tile by rstd and the
norm weight as it goes. Every program computes the same rstd from the same bits.

**Paired columns.** SwiGLU and RoPE both combine two outputs: gate column j with up column j + N/2, and a head's
column i with column i + D/2 (rotate-half). A program owns BLOCK_N such pairs and keeps two accumulators.

**Rounding, the same points as the engine's unfused path** (reference :func:`lessonlib.reference.decode_gemv`):
the normed input rounded to the dtype as add_rms_norm rounds it (``(h * rstd)`` then ``* weight``); a projection
rounded once from its float32 sum (+ bias); RoPE in float32 from the rounded q/k, rounded once on the store; the
residual add in float32 from the rounded product and stream, rounded once. SwiGLU from the float32 sums, as
ops.gemv does it.

**PDL** (``ops._common.pdl``): before ``gdc_wait`` a program loads only its first weight tile(s), which no kernel
of a decode step writes, and writes nothing; the stream, x, the bias, cos, sin and slots are read after the wait. A
program reads and writes only its own columns of the stream (K4, K6), and a kernel that reads the whole stream (K1,
K5) waits for the one that wrote it to end: safe in place, in a graph.

Launchers validate before any launch. No backward, no custom op: the engine calls them at batch-1 decode, eagerly
or under CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib import runtime
from lessonlib.ops._common import (cdiv, check_tensors, gdc_launch_dependents, gdc_wait, launch,
                                   next_power_of_2, pdl_options, refuse_gradient)
from lessonlib.ops.gemv import MAX_ROWS
from lessonlib.ops.rope_store_kv import check_heads_and_caches
from lessonlib.ops.store_kv import check_slot_values, check_slots

STORE, SWIGLU, RESIDUAL, ROPE_KV = 0, 1, 2, 3  # the epilogues: plain store, silu(gate) * up, stream += y, q/k/v


@triton.jit
def _load_x(x_row, k0, ks, K, EVEN_K: tl.constexpr):
    """x[k0:k0 + BLOCK_K] in float32, zeros past K."""
    if EVEN_K:
        return tl.load(x_row + k0 + ks).to(tl.float32)
    return tl.load(x_row + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)


@triton.jit
def _normed(x, norm_ptr, k0, ks, K, rstd, dtype: tl.constexpr):
    """weight * (x * rstd) on a tile, rounded where add_rms_norm rounds: x * rstd, then the product."""
    w = tl.load(norm_ptr + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
    return ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def _row_rstd(x_row, first, ks, K, eps, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over the whole row; ``first`` is its first tile, already loaded (float32)."""
    sum_sq = first * first
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = tl.load(x_row + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
        sum_sq += x * x
    return tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)


@triton.jit
def _rope_kv_epilogue(a, b, pairs, ok, row, half, q_cols, kv_cols, q_ptr, k_cache_ptr, v_cache_ptr, cos_ptr,
                      sin_ptr, slots_ptr, stride_cos_m, stride_sin_m):
    """a, b: the rounded (float32) columns i and i + D/2 of each pair's head. q's heads rotated into q (M, H, D), k's
    rotated into k_cache at the row's slot, v's copied into v_cache there (caches: (slots, Hkv * D) contiguous)."""
    i = pairs % half
    col = (pairs // half) * 2 * half + i  # the pair's first column of qkv
    cos1 = tl.load(cos_ptr + row * stride_cos_m + i, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + row * stride_cos_m + half + i, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + row * stride_sin_m + i, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + row * stride_sin_m + half + i, mask=ok, other=0.0).to(tl.float32)
    is_q, is_v = col < q_cols, col >= q_cols + kv_cols
    rot_a = a * cos1 - b * sin1  # rotate_half(x) = (-x2, x1): apply_rope's formula, half by half
    rot_b = b * cos2 + a * sin2
    out_a = tl.where(is_v, a, rot_a).to(q_ptr.dtype.element_ty)
    out_b = tl.where(is_v, b, rot_b).to(q_ptr.dtype.element_ty)
    q_at = q_ptr + row * q_cols + col
    tl.store(q_at, out_a, mask=ok & is_q)
    tl.store(q_at + half, out_b, mask=ok & is_q)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    k_at = k_cache_ptr + slot * kv_cols + (col - q_cols)
    is_k = ok & (col >= q_cols) & ~is_v
    tl.store(k_at, out_a, mask=is_k)
    tl.store(k_at + half, out_b, mask=is_k)
    v_at = v_cache_ptr + slot * kv_cols + (col - q_cols - kv_cols)
    tl.store(v_at, out_a, mask=ok & is_v)
    tl.store(v_at + half, out_b, mask=ok & is_v)


@triton.jit
def _decode_gemv_kernel(
    x_ptr,  # (M, K), rows stride_xm apart: the input, or with NORM the residual stream before the norm
    norm_ptr,  # (K,) NORM: the RMSNorm weight; else unused
    w_ptr,  # (N, K), rows stride_wn apart; SWIGLU: gate rows then up rows; ROPE_KV: q's, k's, v's heads' rows
    bias_ptr,  # (N,) or unused
    out_ptr,  # STORE, SWIGLU: y (M, N_OUT) contiguous; RESIDUAL: the stream (M, N_OUT), rows stride_om apart,
    #           updated in place; ROPE_KV: q (M, H, D) contiguous
    k_cache_ptr, v_cache_ptr,  # ROPE_KV: (num_slots, Hkv * D) contiguous; else unused
    cos_ptr, sin_ptr,  # ROPE_KV: (M, D), rows stride_cos_m / stride_sin_m apart; else unused
    slots_ptr,  # ROPE_KV: (M,) integer cache slot of each row; else unused
    N_OUT,  # outputs per row: columns (STORE, RESIDUAL), gate columns (SWIGLU), column pairs (ROPE_KV)
    K, stride_xm, stride_wn, stride_om, stride_cos_m, stride_sin_m, eps,
    half, q_cols, kv_cols,  # ROPE_KV: D / 2, H * D, Hkv * D
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch: load weights, then wait
):
    """Program (n, m): outputs [n * BLOCK_N, (n + 1) * BLOCK_N) of row m (pairs of columns when paired)."""
    # EPILOGUE: 0 STORE, 1 SWIGLU, 2 RESIDUAL, 3 ROPE_KV (the module's constants; a kernel reads no Python global)
    PAIRED: tl.constexpr = EPILOGUE == 1 or EPILOGUE == 3
    pairs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    ok = pairs < N_OUT
    if EPILOGUE == 3:  # ROPE_KV: pair p is column i = p mod D/2 of head p div D/2, and column i + D/2
        col_a = (pairs // half) * 2 * half + pairs % half
        col_b = col_a + half
    else:  # SWIGLU: gate column p and up column p + N_OUT
        col_a = pairs
        col_b = pairs + N_OUT
    w_a = w_ptr + col_a[:, None].to(tl.int64) * stride_wn + ks[None, :]
    w_b = w_ptr + col_b[:, None].to(tl.int64) * stride_wn + ks[None, :]
    w_mask = ok[:, None] if EVEN_K else ok[:, None] & (ks[None, :] < K)
    # Weights depend on nothing a decode step writes: their first tiles load before the wait.
    wa = tl.load(w_a, mask=w_mask, other=0.0)
    if PAIRED:
        wb = tl.load(w_b, mask=w_mask, other=0.0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # x (the stream, the attention output, ...) is the previous kernel's output
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_xm
    x = _load_x(x_row, 0, ks, K, EVEN_K)
    rstd = 1.0
    if NORM:  # the row's first tile serves both the sum of squares and the first products
        rstd = _row_rstd(x_row, x, ks, K, eps, BLOCK_K)
        x = _normed(x, norm_ptr, 0, ks, K, rstd, dtype)
    acc_a = tl.sum(wa.to(tl.float32) * x[None, :], axis=1)
    acc_b = acc_a
    if PAIRED:
        acc_b = tl.sum(wb.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = _load_x(x_row, k0, ks, K, EVEN_K)
        if NORM:
            x = _normed(x, norm_ptr, k0, ks, K, rstd, dtype)
        tile_mask = w_mask if EVEN_K else ok[:, None] & (k0 + ks < K)[None, :]
        acc_a += tl.sum(tl.load(w_a + k0, mask=tile_mask, other=0.0).to(tl.float32) * x[None, :], axis=1)
        if PAIRED:
            acc_b += tl.sum(tl.load(w_b + k0, mask=tile_mask, other=0.0).to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc_a += tl.load(bias_ptr + col_a, mask=ok, other=0.0).to(tl.float32)
        if PAIRED:
            acc_b += tl.load(bias_ptr + col_b, mask=ok, other=0.0).to(tl.float32)
    if EPILOGUE == 3:  # ROPE_KV
        _rope_kv_epilogue(acc_a.to(dtype).to(tl.float32), acc_b.to(dtype).to(tl.float32), pairs, ok, row, half,
                          q_cols, kv_cols, out_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, slots_ptr,
                          stride_cos_m, stride_sin_m)
    elif EPILOGUE == 2:  # RESIDUAL: stream += y: y rounded first (the product's output), then the sum rounded once
        at = out_ptr + row * stride_om + pairs
        stream = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        tl.store(at, (acc_a.to(dtype).to(tl.float32) + stream).to(dtype), mask=ok)
    elif EPILOGUE == 1:  # SWIGLU, from the float32 sums as ops.gemv
        tl.store(out_ptr + row * N_OUT + pairs, (acc_a * tl.sigmoid(acc_a) * acc_b).to(dtype), mask=ok)
    else:
        tl.store(out_ptr + row * N_OUT + pairs, acc_a.to(dtype), mask=ok)


# GPU tiles (BLOCK_N outputs, BLOCK_K, warps) per epilogue: each reads the bytes per program ops.gemv's H200 sweep
# chose for the same matrix (benchmarks/experiments/decode_layer_pdl.py): qkv 4 rows x 2048 (here 2 pairs), o and
# down 4 rows x 2048; gate_up 4 rows x 2048 (8 x 1024 before: the whole batch-1 step 2% faster on the Llama-3.2-1B
# shape, the same on Qwen2.5-0.5B's, in benchmarks/experiments/decode_step_tiles.py).
GPU_TILES = {STORE: (4, 2048, 4), RESIDUAL: (4, 2048, 4), SWIGLU: (4, 2048, 4), ROPE_KV: (2, 2048, 4)}


def config(n_out: int, k: int, epilogue: int) -> dict:
    """Tiles: :data:`GPU_TILES` on a GPU, BLOCK_K no wider than K; where K is narrower, qkv's programs take as many
    more pairs as BLOCK_K lost, so each still reads the table's bytes (Qwen2.5-0.5B's K = 896: 4 pairs x 1024, its
    batch-1 step 5% faster than at 2 x 1024; the other epilogues were no faster so: decode_step_tiles.py). In the
    interpreter, where each program instance costs milliseconds of Python whatever its size, as few programs as the
    arrays allow."""
    if runtime.gpu_profile() is not None:
        block_n, block_k, warps = GPU_TILES[epilogue]
        narrowed = min(block_k, next_power_of_2(k))
        if epilogue == ROPE_KV:
            block_n *= block_k // narrowed
        return {"BLOCK_N": block_n, "BLOCK_K": narrowed, "num_warps": warps}
    return {"BLOCK_N": min(next_power_of_2(n_out), 256), "BLOCK_K": min(next_power_of_2(k), 256), "num_warps": 4}


def _span(t: torch.Tensor) -> tuple[int, int]:
    """t's first byte and one past its last."""
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.nbytes
    return start, start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _refuse_overlap(op: str, name: str, written: torch.Tensor, **read: torch.Tensor) -> None:
    """The kernel writes ``written`` while other programs read each of ``read`` (whole, or written elsewhere): bytes
    in common would be a race, whatever the order. Views of one allocation that do not overlap pass (a k and a v
    cache side by side, say). A few microseconds of host time: the engine captures these calls in a graph."""
    if not written.numel():
        return
    w0, w1 = _span(written)
    for other, t in read.items():
        if t.numel():
            r0, r1 = _span(t)
            if w0 < r1 and r0 < w1:
                raise ValueError(f"{op}: {name} overlaps {other} in memory; the kernel writes {name} while it "
                                 f"reads {other}: pass separate tensors")


def _check(op, x, weight, bias, norm_weight, eps, **more):
    """What every launcher checks, before any launch."""
    tensors = {"x": x, "weight": weight, **({"bias": bias} if bias is not None else {}),
               **({"norm_weight": norm_weight} if norm_weight is not None else {}), **more}
    check_tensors(op, **tensors)
    refuse_gradient(op, "it has no backward: an inference kernel for decode at batch 1", **tensors)
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{op}: x must be (M, K) and weight (N, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or k == 0:
        raise ValueError(f"{op}: x has K={k} columns and weight K={weight.shape[1]}; both must match, at least 1")
    if m > MAX_ROWS:
        raise ValueError(f"{op}: x has {m} rows, at most {MAX_ROWS}: decode_gemv is for a few tokens")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{op}: bias must be (N,) = ({n},), got {tuple(bias.shape)}")
    if norm_weight is not None and tuple(norm_weight.shape) != (k,):
        raise ValueError(f"{op}: norm_weight must be (K,) = ({k},), got {tuple(norm_weight.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"{op}: eps must be a positive number, got {eps!r}")


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                norm_weight: torch.Tensor | None = None, eps: float = 1e-6, activation: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.gemv(x, weight, bias, activation)`` with an RMSNorm prologue and a residual-add epilogue, like
    :func:`lessonlib.reference.decode_gemv`.

    x: (M, K); weight: (N, K); bias: (N,) or None; norm_weight: (K,) or None: with it the product reads
    ``add_rms_norm``'s normed x (``norm_weight * rms_norm(x)``, eps ``eps``) instead of x. ``activation="swiglu"``:
    weight holds gate rows then up rows, returns (M, N/2). ``residual``: (M, N), updated in place,
    ``residual += y`` (y rounded first), and returned; it must not overlap x (other programs read x whole).
    Same dtype everywhere, last dimensions contiguous. No host sync: CUDA-graph safe. No backward.
    """
    op = "decode_gemv"
    _check(op, x, weight, bias, norm_weight, eps, **({"residual": residual} if residual is not None else {}))
    if activation not in (None, "swiglu"):
        raise ValueError(f"{op}: activation must be None or 'swiglu', got {activation!r}")
    (m, k), n = x.shape, weight.shape[0]
    if activation == "swiglu" and (n % 2 or residual is not None):
        raise ValueError(f"{op}: activation='swiglu' needs an even N (gate rows, then up rows) and no residual; got "
                         f"N={n}{' and a residual' if residual is not None else ''}")
    if residual is not None:
        if tuple(residual.shape) != (m, n):
            raise ValueError(f"{op}: residual must be (M, N) = ({m}, {n}), got {tuple(residual.shape)}")
        if m > 1 and residual.stride(0) < n:  # an expanded row, say: two programs would add into one element
            raise ValueError(f"{op}: residual's rows overlap (row stride {residual.stride(0)}, N={n}); it is "
                             "updated in place, each row its own")
        _refuse_overlap(op, "residual", residual, x=x)
        y, epilogue, n_out = residual, RESIDUAL, n
    else:
        swiglu = activation == "swiglu"
        n_out = n // 2 if swiglu else n
        y, epilogue = torch.empty(m, n_out, dtype=x.dtype, device=x.device), SWIGLU if swiglu else STORE
    if m == 0 or n == 0:  # nothing to compute (and no program to launch: a grid of zero)
        return y
    _launch(x, weight, bias, norm_weight, eps, y, y.stride(0), epilogue, n_out, (y,) * 5, (0, 0, 0, 0, 0))
    return y


def _launch(x, weight, bias, norm_weight, eps, out, stride_om, epilogue, n_out, rope_args, rope_ints):
    meta = config(n_out, x.shape[1], epilogue)
    launch(_decode_gemv_kernel, (cdiv(n_out, meta["BLOCK_N"]), x.shape[0]),
           x, norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight, out,
           *rope_args, n_out, x.shape[1], x.stride(0), weight.stride(0), stride_om, *rope_ints[:2], float(eps),
           *rope_ints[2:], NORM=norm_weight is not None, HAS_BIAS=bias is not None, EPILOGUE=epilogue,
           EVEN_K=x.shape[1] % meta["BLOCK_K"] == 0, **meta, **pdl_options())


def decode_qkv_rope_store_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             norm_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *, num_heads: int,
                             num_kv_heads: int, eps: float = 1e-6, validate: bool = True) -> torch.Tensor:
    """The qkv projection with the RMSNorm prologue and ``rope_store_kv`` as its epilogue, one launch, like
    :func:`lessonlib.reference.decode_qkv_rope_store_kv`: ``qkv = decode_gemv(x, weight, bias, norm_weight=...)``,
    then q rotated (returned, (M, H, D)), k rotated into k_cache and v copied into v_cache at ``slots``.

    weight: ((H + 2 Hkv) D, K), q's rows then k's then v's; cos, sin: (M, D); caches (num_blocks, block_size, Hkv,
    D) contiguous; slots (M,) integer, distinct, each below num_blocks * block_size. ``validate=False`` skips the
    check of the slots' values (a device sync and a sort: never under CUDA-graph capture), as ``rope_store_kv``'s
    does: only for trusted slots, such as the engine's. k_cache and v_cache must not overlap each other or x. A
    program owns pairs of columns (i, i + D/2) of one head, the two halves rotate-half mixes. Full rotary only;
    Qwen3's q/k norm (between the product and RoPE) is not here: the engine keeps its unfused path for it.
    """
    op = "decode_qkv_rope_store_kv"
    _check(op, x, weight, bias, norm_weight, eps, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    m, head_dim = x.shape[0], check_heads_and_caches(op, k_cache, v_cache, num_heads, num_kv_heads)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if weight.shape[0] != width:
        raise ValueError(f"{op}: weight must have (num_heads + 2 num_kv_heads) head_dim = ({num_heads} + 2 * "
                         f"{num_kv_heads}) * {head_dim} = {width} rows, got {weight.shape[0]}")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (m, head_dim):
            raise ValueError(f"{op}: {name} must be (M, head_dim) = ({m}, {head_dim}), got {tuple(table.shape)}")
    check_slots(op, slots, m, x.device)
    _refuse_overlap(op, "k_cache", k_cache, v_cache=v_cache, x=x)
    _refuse_overlap(op, "v_cache", v_cache, x=x)
    if validate and m:  # reads slots on the host: a sync
        check_slot_values(op, slots, k_cache.shape[0] * k_cache.shape[1])
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if m == 0:
        return q
    half = head_dim // 2
    _launch(x, weight, bias, norm_weight, eps, q, 0, ROPE_KV, width // 2, (k_cache, v_cache, cos, sin, slots),
            (cos.stride(0), sin.stride(0), half, num_heads * head_dim, num_kv_heads * head_dim))
    return q
