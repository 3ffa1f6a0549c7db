"""The forward kernel of ``lessonlib.ops.flash_attention`` (launched there): one program per (query tile, batch x
head) streams the key/value tiles of its KV head through on-chip memory, keeps the online-softmax state in registers,
and writes the output and the log-sum-exp once.

Stride arguments follow the course's one scheme (see ``lessonlib.ops``): ``stride_qm`` is q's stride between query
rows, ``stride_kn`` k's between key rows, ``stride_qb``/``stride_qh`` between batches/heads.
"""

import triton
import triton.language as tl

# exp(x) = exp2(x * LOG2E): the kernels work in log2 units, where the GPU's exponential is one instruction.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e); a constexpr, the only kind of global a Triton kernel may read


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start_m, lo, hi, n_kv,
                  causal_offset, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Fold key/value tiles [lo, hi) into the online-softmax state. MASKED: bounds, causal mask."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = lo + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # Offsets inside one tile, computed once; each step moves a single scalar base. (Advancing the
    # tile of pointers itself costs a 64-bit add per pointer per step, and registers: about 0.9x the
    # speed at D=64 on the H200.)
    k_tile = tl.arange(0, BLOCK_N)[None, :] * stride_kn + offs_d[:, None]  # Kᵀ: (D, BLOCK_N)
    v_tile = tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_d[None, :]  # (BLOCK_N, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        k_ptrs = k_base + tl.cast(start_n, tl.int64) * stride_kn + k_tile
        v_ptrs = v_base + tl.cast(start_n, tl.int64) * stride_vn + v_tile
        if MASKED:
            in_bounds = offs_n < n_kv
            k = tl.load(k_ptrs, mask=in_bounds[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, k)  # raw scores; scaled into log2 units inside the exponent below
        if MASKED:
            visible = in_bounds[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one fused multiply-add per score
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was summed under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=in_bounds[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # added into the rescaled acc
        m_i = m_new
        offs_n += BLOCK_N
    return acc, m_i, l_i


@triton.jit
def _flash_attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    heads, n_q, n_kv, sm_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    tile = tl.program_id(0)
    if CAUSAL:  # the last query tiles see the most keys: launch them first, so short tiles fill the tail
        tile = tl.num_programs(0) - 1 - tile
    start_m = tile * BLOCK_M
    batch = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    kv_head = head // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    k_base = k_ptr + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=offs_m[:, None] < n_q, other=0.0)

    # A finite start for the running max: a row that sees no key keeps l = 0 and no inf - inf appears.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E  # exp(x) = exp2(x * log2(e))

    # Key tiles [0, full_hi) are visible to every row of this query tile and in bounds: no mask.
    # Tiles [full_hi, hi) need one; tiles from hi on are above the diagonal (causal) or past the end: skipped.
    causal_offset = n_kv - n_q
    if CAUSAL:  # the tile's last real query row sees keys up to (last row + offset): see key_tile_bounds()
        hi = tl.minimum(n_kv, tl.minimum(start_m + BLOCK_M, n_q) + causal_offset)
        full_hi = tl.minimum((start_m + causal_offset + 1) // BLOCK_N * BLOCK_N, n_kv // BLOCK_N * BLOCK_N)
    else:
        hi = n_kv
        full_hi = n_kv // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), 0)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start_m, 0, full_hi, n_kv,
                                  causal_offset, qk_scale, False, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, start_m, full_hi, hi, n_kv,
                                  causal_offset, qk_scale, True, CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # a row that saw no key: 0
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))
    row_ok = offs_m < n_q
    o_base = out_ptr + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(lse_ptr + (batch * heads + head).to(tl.int64) * n_q + offs_m, lse, mask=row_ok)
