"""paged_prefill_attention: prefill attention that reads keys and values through block tables, so that a prompt
whose first blocks are already cached (prefix caching) only computes its new tokens.

``flash_attention`` reads K and V from contiguous (B, Hkv, N, D) tensors, which is right for a prompt computed from
scratch. A prompt that reuses a cached prefix has its prefix's K and V scattered over the pool's blocks: copying
them into a contiguous tensor first would cost a full read and write of the prefix. This kernel follows the block
table instead, as ``paged_attention`` does for decode, but with many query rows per sequence and a causal mask:
new token i of a sequence of length n with q new tokens sits at position n - q + i and sees keys 0 .. n - q + i.

Sequences of different lengths are packed into one launch (the varlen layout of FlashAttention's
``flash_attn_varlen_func``): sequence b's new tokens are rows ``query_starts[b] .. query_starts[b + 1] - 1`` of q.
One program per (query tile, sequence, query head); a tile past its sequence's new tokens does nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib import runtime
from lessonlib.ops._common import first_that_fits, launch, refuse_gradient
from lessonlib.ops.flash_attention import forward_shared_memory
from lessonlib.ops.paged_attention import _check_tables, _online_softmax_step, check_cache, check_int32_rows


@triton.jit
def _paged_prefill_attention_kernel(
    q_ptr,  # (T, H, D): new tokens of every sequence, packed; last dimension contiguous
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, Hkv, D) contiguous, the new tokens' K/V already stored
    block_table_ptr,  # (B, max_blocks) int32
    seq_lens_ptr,  # (B,) int32: lengths including the new tokens
    query_starts_ptr,  # (B + 1,) int32: sequence b's new tokens are q rows query_starts[b] .. query_starts[b+1]-1
    out_ptr,  # (T, H, D) contiguous
    sm_scale,
    stride_qt, stride_qh,
    stride_table_b,
    stride_cache_block, stride_cache_token, stride_cache_head,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per loop step (may span several cache blocks)
    PAGE_SIZE: tl.constexpr,  # tokens per cache block (a page): the launcher's block_size
    HEAD_DIM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 (no tf32 rounding), else the default
    PRECISE_EXP: tl.constexpr,  # float32 on the GPU: libdevice's exp (see paged_attention._exp)
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_starts_ptr + b)
    q_len = tl.load(query_starts_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len  # tokens before the first new one (the cached prefix)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this sequence's new tokens
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=m_ok[:, None], other=0.0)

    # A finite start for the running max, as flash_attention: a masked-out row never computes inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # The tile's last row sees keys up to context + its index; a tile past the new tokens visits nothing.
    hi = tl.where(tile * BLOCK_M < q_len, tl.minimum(seq_len, context + tile * BLOCK_M + BLOCK_M), 0)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + offs_n
        in_seq = keys < seq_len
        physical = tl.load(block_table_ptr + b * stride_table_b + keys // PAGE_SIZE, mask=in_seq, other=0).to(tl.int64)
        offsets = (physical * stride_cache_block + (keys % PAGE_SIZE) * stride_cache_token)[:, None] \
            + kv_head * stride_cache_head + offs_d[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=in_seq[:, None], other=0.0)  # (BLOCK_N, D)
        v = tl.load(v_cache_ptr + offsets, mask=in_seq[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N)
        visible = in_seq[None, :] & (keys[None, :] <= context + offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, PRECISE_EXP, INPUT_PRECISION)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # every real row sees key 0 at least: l_i > 0 there
    heads = tl.num_programs(2)
    tl.store(out_ptr + (rows[:, None] * heads + head) * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None])


# (BLOCK_M, BLOCK_N, num_warps, num_stages), best first; the launcher takes the first whose shared memory fits the
# GPU. 64 query rows x 64 keys is flash_attention's forward tile at D=64 (its H200 sweep's best there); not swept
# for this kernel. Below sm_80 Triton's tl.dot runs on FMA units: flash_attention's sm_75 tiles, which compile
# without spills there (tools/compile_targets.py --registers).
LADDER = ((64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2))
LADDER_SM75 = ((32, 32, 4, 1), (32, 16, 4, 1))


def config(head_dim: int = 128, itemsize: int = 2, profile: runtime.GPUProfile | None = None) -> dict:
    """Query rows per program, keys per step, warps and stages for ``profile`` (default: this GPU's). 16 x 16 in the
    interpreter (each step is NumPy work). Shared memory: :func:`shared_memory`."""
    profile = profile or runtime.gpu_profile()
    if profile is None:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)
    ladder = LADDER if profile.triton_tensor_cores else LADDER_SM75
    candidates = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s) for m, n, w, s in ladder]
    return first_that_fits("paged_prefill_attention", candidates, lambda c: shared_memory(c, head_dim, profile, itemsize),
                           profile)


def shared_memory(config: dict, head_dim: int, profile: runtime.GPUProfile, itemsize: int = 2) -> int:
    """Upper bound on the kernel's shared memory: flash_attention's forward estimate (the same Q tile and K/V tiles in
    flight) plus 1 KB for the gathered rows' block-table lookups (compiled for sm_80 in float32 at 64 x 64, 2 stages:
    112.2 KB against 112.0 for the tiles alone). Checked against the compiled kernels by
    tests/ops/test_compile_targets.py."""
    return forward_shared_memory(config, head_dim, profile, itemsize) + 1024


def check_inputs(q, k_cache, v_cache, block_table, seq_lens, query_starts, max_query_len, *, validate=True) -> None:
    """Every check :func:`paged_prefill_attention` makes before launching."""
    num_blocks, block_size = check_cache("paged_prefill_attention", q, k_cache, v_cache, "(T, H, D)",
                                          min_block_size=1)
    tokens = q.shape[0]
    batch = block_table.shape[0] if isinstance(block_table, torch.Tensor) else -1
    check_int32_rows("paged_prefill_attention", q.device, block_table=(block_table, 2, batch),
                     seq_lens=(seq_lens, 1, batch), query_starts=(query_starts, 1, batch + 1))
    if not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"paged_prefill_attention: max_query_len must be a positive int, got {max_query_len!r}")
    if validate:  # one device sync: the packing must cover q exactly and every sequence hold its new tokens
        _check_tables(block_table, seq_lens, num_blocks, block_size)
        q_lens = query_starts[1:] - query_starts[:-1]
        first, last, shortest, longest, too_few = torch.stack([
            query_starts[0], query_starts[-1], q_lens.min(), q_lens.max(), (seq_lens < q_lens).any().int(),
        ]).tolist()
        if first != 0 or last != tokens or shortest < 1:
            raise ValueError(f"paged_prefill_attention: query_starts must rise from 0 to T={tokens}, every sequence "
                             "with at least one new token")
        if longest > max_query_len:
            raise ValueError(f"paged_prefill_attention: a sequence has {longest} new tokens, more than "
                             f"max_query_len={max_query_len}")
        if too_few:
            raise ValueError("paged_prefill_attention: a seq_len is shorter than its number of new tokens")


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    query_starts: torch.Tensor, max_query_len: int, sm_scale: float | None = None, validate: bool = True,
) -> torch.Tensor:
    """Causal prefill attention through block tables, like ``lessonlib.reference.paged_prefill_attention``.

    q: (T, H, D), the new tokens of B sequences packed (sequence b's are rows ``query_starts[b]`` to
    ``query_starts[b + 1] - 1``); their K and V must already be in the cache (``store_kv``). k_cache, v_cache:
    (num_blocks, block_size, Hkv, D); block_table: (B, max_blocks) int32; seq_lens: (B,) int32, each length
    including the new tokens; query_starts: (B + 1,) int32; ``max_query_len``: the most new tokens of any sequence
    (it sizes the grid without reading query_starts on the host). ``validate=False`` skips the checks that read the
    int tensors on the device (a sync): only for tables built by a trusted source, such as the engine's block
    manager. Returns (T, H, D).
    """
    refuse_gradient("paged_prefill_attention", "it has no backward: a prefill kernel for serving; train with "
                    "flash_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    check_inputs(q, k_cache, v_cache, block_table, seq_lens, query_starts, max_query_len, validate=validate)
    tokens, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    meta = config(head_dim, q.dtype.itemsize)
    grid = (triton.cdiv(max_query_len, meta["BLOCK_M"]), block_table.shape[0], heads)
    launch(
        _paged_prefill_attention_kernel, grid,
        q, k_cache, v_cache, block_table, seq_lens, query_starts, out,
        sm_scale if sm_scale is not None else head_dim ** -0.5,
        q.stride(0), q.stride(1), block_table.stride(0), *k_cache.stride()[:3],
        GROUP=heads // kv_heads, PAGE_SIZE=block_size, HEAD_DIM=head_dim,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PRECISE_EXP=q.dtype == torch.float32 and runtime.on_gpu(), **meta,
    )
    return out
