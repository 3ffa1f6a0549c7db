"""The backward kernels of ``lessonlib.ops.flash_attention`` (FlashAttention-2, launched there): P is recomputed
from Q, K and the saved log-sum-exp. One kernel per key/value tile accumulates dK and dV over every query tile and
every query head of its GQA group (no atomics); one kernel per query tile accumulates dQ over the key/value tiles.
"""

import triton
import triton.language as tl

from lessonlib.ops._flash_attention_forward import LOG2E


@triton.jit
def _flash_attention_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    heads, kv_heads, n_q, n_kv, sm_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """dK, dV for one key/value tile of one KV head: sum over its GROUP query heads and the query tiles that see it."""
    start_n = tl.program_id(0) * BLOCK_N
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < n_kv
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    causal_offset = n_kv - n_q
    lo = 0
    if CAUSAL:  # query i sees key j when i >= j - offset: start at the query tile holding start_n - offset
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
    q_tile = tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]  # offsets inside one tile, as forward
    do_tile = tl.arange(0, BLOCK_M)[:, None] * stride_dom + offs_d[None, :]
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_base = q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
        do_base = do_ptr + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
        row_base = (batch * heads + head).to(tl.int64) * n_q
        offs_m = lo + tl.arange(0, BLOCK_M)
        for start_m in range(lo, n_q, BLOCK_M):
            m_ok = offs_m < n_q
            q = tl.load(q_base + tl.cast(start_m, tl.int64) * stride_qm + q_tile, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_base + tl.cast(start_m, tl.int64) * stride_dom + do_tile, mask=m_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + row_base + offs_m, mask=m_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + row_base + offs_m, mask=m_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M): scores transposed, log2 units
            visible = n_ok[:, None] & m_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
            p_t = tl.where(visible, tl.math.exp2(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
            offs_m += BLOCK_M
    dk *= sm_scale
    out_offsets = (batch * kv_heads + kv_head).to(tl.int64) * n_kv * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dk_ptr + out_offsets, dk.to(dk_ptr.dtype.element_ty), mask=n_ok[:, None])
    tl.store(dv_ptr + out_offsets, dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _flash_attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    heads, n_q, n_kv, sm_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """dQ for one query tile of one head: sum over the key/value tiles it sees."""
    start_m = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    kv_head = head // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < n_q
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    do_base = do_ptr + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    row_base = (batch * heads + head).to(tl.int64) * n_q
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + row_base + offs_m, mask=m_ok, other=0.0) * LOG2E
    delta = tl.load(delta_ptr + row_base + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    causal_offset = n_kv - n_q
    hi = n_kv
    if CAUSAL:
        hi = tl.maximum(tl.minimum(n_kv, tl.minimum(start_m + BLOCK_M, n_q) + causal_offset), 0)
    offs_n = tl.arange(0, BLOCK_N)
    k_tile = offs_n[:, None] * stride_kn + offs_d[None, :]  # offsets inside one tile, as forward
    v_tile = offs_n[:, None] * stride_vn + offs_d[None, :]
    for start_n in range(0, hi, BLOCK_N):
        n_ok = offs_n < n_kv
        k = tl.load(k_base + tl.cast(start_n, tl.int64) * stride_kn + k_tile, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_base + tl.cast(start_n, tl.int64) * stride_vn + v_tile, mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        p = tl.where(visible, tl.math.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        offs_n += BLOCK_N
    dq *= sm_scale
    out_offsets = (batch * heads + head).to(tl.int64) * n_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptr + out_offsets, dq.to(dq_ptr.dtype.element_ty), mask=m_ok[:, None])
