"""paged_attention: decode attention (one new query token per sequence) over a paged KV cache, split along the
sequence (flash-decoding).

Each sequence's keys and values live in fixed-size blocks scattered over a pool; its block table maps logical
block i to a physical block. The kernel follows the table. Decode has one query row per head, so one program per
(sequence, KV head) would leave most of the GPU idle for a few long sequences: the sequence is split into
``num_splits`` ranges, each program computes a partial softmax-weighted sum over its range (keeping the running max
and sum, as FlashAttention does), and a second kernel combines the partial results.

All query heads that share a KV head (grouped-query attention) are handled by the same program, so each K/V block is
read once per KV head, not once per query head.

``paged_attention`` is the op a model calls: the custom op ``torch.ops.lessonlib.paged_attention`` (with a fake
implementation) under torch.compile, the launcher directly otherwise. It has no backward (a serving kernel: train
with ``flash_attention``), so it refuses inputs that require grad rather than return a tensor without a gradient.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lessonlib import runtime
from lessonlib.ops._common import (check_tensors, first_that_fits, launch, next_power_of_2, pdl_options,
                                   pdl_wait_then_trigger, refuse_gradient)

HEAD_DIMS = (16, 32, 64, 128, 256)
REDUCE_WARPS = 4  # the reduce kernel: a (splits, D) float32 tile per program, shared memory only for its sums
MIN_BLOCKS_PER_SPLIT = 4  # a split shorter than this spends more on its partial result than on K/V
TOKENS_PER_STEP = 64  # K/V rows gathered per loop iteration (several cache blocks), where it fits: split_config


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    """exp. On the GPU ``tl.exp`` is the fast approximate instruction (a few units of rounding off in float32,
    invisible in bf16/fp16); PRECISE uses CUDA's libdevice ``expf`` (within 2 units) instead, for float32 inputs."""
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _online_softmax_step(m, l, acc, scores, v, PRECISE_EXP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One tile of keys folded into the running (max, sum, output) of each query row: lesson 02's online softmax.
    ``scores`` (rows, tokens) with -inf where a key is not visible; ``v`` (tokens, D). Returns the new m, l, acc."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = _exp(m - m_new, PRECISE_EXP)
    p = _exp(scores - m_new[:, None], PRECISE_EXP)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l, acc


@triton.jit
def _paged_attention_split_kernel(
    q_ptr,  # (B, H, D), rows contiguous
    k_cache_ptr, v_cache_ptr,  # (num_blocks, block_size, Hkv, D) contiguous
    block_table_ptr,  # (B, max_blocks) int32
    seq_lens_ptr,  # (B,) int32
    partial_out_ptr,  # (B, H, num_splits, D) float32: unnormalised sum of p * v over the split
    partial_max_ptr, partial_sum_ptr,  # (B, H, num_splits) float32: running max and sum of exp(score - max)
    sm_scale,
    stride_qb, stride_qh,
    stride_table_b,
    stride_cache_block, stride_cache_token, stride_cache_head,
    num_splits, blocks_per_split,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a tl.dot-friendly 16
    PAGE_SIZE: tl.constexpr,  # tokens per cache block (a page): the launcher's block_size
    PAGES_PER_STEP: tl.constexpr,  # cache blocks gathered per loop iteration (the launcher's blocks_per_step)
    HEAD_DIM: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no tf32 rounding), else the default
    PRECISE_EXP: tl.constexpr,  # float32 inputs on the GPU: precise exp (see _exp)
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (ops._common.pdl_options)
):
    pdl_wait_then_trigger(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, PAGE_SIZE)
    heads = kv_head * GROUP + g  # the query heads served by this KV head
    g_mask = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, PAGE_SIZE))
    # PAGES_PER_STEP cache blocks per iteration: one 16-token block (4 KB of K) is too little work per step to
    # keep enough loads in flight. Token j of a step lives in block table[logical + j // PAGE_SIZE].
    j = tl.arange(0, PAGES_PER_STEP * PAGE_SIZE)
    for logical in range(first, last, PAGES_PER_STEP):
        block_of_token = logical + j // PAGE_SIZE
        in_split = block_of_token < last
        physical = tl.load(block_table_ptr + b * stride_table_b + block_of_token, mask=in_split, other=0).to(tl.int64)
        offsets = (physical * stride_cache_block + (j % PAGE_SIZE) * stride_cache_token)[:, None] \
            + kv_head * stride_cache_head + d[None, :]
        # Slots past the sequence's length are not read at all: whatever they hold (a freed sequence's K/V, NaN)
        # would otherwise reach the output as 0 * v.
        valid = in_split & ((logical * PAGE_SIZE + j) < seq_len)
        k = tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0)  # (PAGES_PER_STEP * PAGE_SIZE, D)
        v = tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale  # (BLOCK_G, tokens)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m, l, acc = _online_softmax_step(m, l, acc, scores, v, PRECISE_EXP, INPUT_PRECISION)

    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # index into (B, H, num_splits)
    tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])
    tl.store(partial_max_ptr + row, m, mask=g_mask)
    tl.store(partial_sum_ptr + row, l, mask=g_mask)


@triton.jit
def _paged_attention_reduce_kernel(
    partial_out_ptr, partial_max_ptr, partial_sum_ptr,  # as written by the split kernel
    out_ptr,  # (B, H, D) contiguous
    num_splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (ops._common.pdl_options)
):
    pdl_wait_then_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    s_mask = s < num_splits
    m = tl.load(partial_max_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    l = tl.load(partial_sum_ptr + row * num_splits + s, mask=s_mask, other=0.0)
    acc = tl.load(partial_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    weight = tl.where(m > float("-inf"), _exp(m - m_all, PRECISE_EXP), 0.0)  # a split past the sequence's end weighs 0
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def split_shared_memory(config: dict, head_dim: int, block_size: int, group: int, itemsize: int) -> int:
    """Upper bound on the split kernel's shared memory: the K and V rows of one step (the loads are gathers through
    the block table, which Triton does not pipeline: the compiled kernels need the same bytes at 2 and 3 stages) plus
    a quarter for the layout conversions around the two products, and the query-side tiles (q and p as operands, up
    to 4 x BLOCK_G x D bytes: measured on sm_75, less elsewhere). Compiled at D=128, 16 bits, 64 tokens: 39 KB on
    sm_80/sm_90 and 40 KB on sm_75, for 32 KB of K and V rows; at 32 tokens on sm_75 24 KB. Checked against the
    compiled kernels by tests/ops/test_compile_targets.py."""
    kv = 2 * config["PAGES_PER_STEP"] * block_size * head_dim * itemsize
    return 5 * kv // 4 + 4 * _block_g(group) * head_dim


def _block_g(group: int) -> int:
    return max(16, next_power_of_2(group))  # the query heads of one KV head, padded to a tl.dot-friendly 16


@lru_cache(maxsize=None)
def _split_config(head_dim: int, block_size: int, group: int, itemsize: int, profile: runtime.GPUProfile | None) -> dict:
    if profile is None:  # the interpreter: no shared memory to fit
        return dict(PAGES_PER_STEP=max(1, TOKENS_PER_STEP // block_size), num_warps=4)
    # TOKENS_PER_STEP rows per step where they fit (the H200's choice, every benchmark shape there), else half, then a
    # quarter: a T4's 64 KB holds 64 rows of D=128 in 16 bits but not in float32, nor 64 rows of D=256. On sm_75
    # (FMA products) 64 rows spill (D=128, 16 bits: 255 registers and 640 B of spill stores; 32 rows: 208 registers,
    # none; Triton 3.9, tools/compile_targets.py --registers), so a T4 starts at 32.
    steps = (TOKENS_PER_STEP, TOKENS_PER_STEP // 2, TOKENS_PER_STEP // 4)
    ladder = [dict(PAGES_PER_STEP=max(1, tokens // block_size), num_warps=4)
              for tokens in (steps if profile.triton_tensor_cores else steps[1:])]
    return first_that_fits("paged_attention", ladder,
                           lambda c: split_shared_memory(c, head_dim, block_size, group, itemsize), profile)


def split_config(head_dim: int, block_size: int, group: int, dtype: torch.dtype,
                 profile: runtime.GPUProfile | None = None) -> dict:
    """Cache blocks per loop step and warps of the split kernel, for ``group`` query heads per KV head, on ``profile``
    (default: this GPU's, see runtime.gpu_profile). num_stages is Triton's default: the gathers are not pipelined
    (see split_shared_memory)."""
    return _split_config(head_dim, block_size, group, dtype.itemsize, profile or runtime.gpu_profile())


def _multiprocessors() -> int:
    profile = runtime.gpu_profile()
    return profile.multiprocessors if profile is not None else 4


def num_splits_for(batch: int, kv_heads: int, max_blocks: int, multiprocessors: int | None = None) -> int:
    """Splits per sequence so that (batch x KV heads x splits) programs fill the GPU about four times over (four
    programs per SM: enough loads in flight to keep HBM busy), rounded down to a power of two, each split at least
    MIN_BLOCKS_PER_SPLIT blocks long. ``multiprocessors``: the GPU's SM count (default: this GPU's; an H200 has
    132). On the H200 this picked the fastest of the swept split counts at all four benchmark shapes
    (benchmarks/bench_paged_attention.py)."""
    wanted = 4 * (multiprocessors or _multiprocessors()) // (batch * kv_heads)
    wanted = 1 << (wanted.bit_length() - 1) if wanted > 1 else 1
    return max(1, min(wanted, max_blocks // MIN_BLOCKS_PER_SPLIT))


def _check_tables(block_table, seq_lens, num_blocks, block_size) -> None:
    """Every seq_len in [1, capacity] and every block a sequence uses inside the pool. One device sync."""
    max_blocks = block_table.shape[1]
    used = torch.arange(max_blocks, device=block_table.device)[None, :] < ((seq_lens + block_size - 1) // block_size)[:, None]
    too_short, too_long, outside = torch.stack([
        (seq_lens < 1).any(), (seq_lens > max_blocks * block_size).any(),
        (used & ((block_table < 0) | (block_table >= num_blocks))).any(),
    ]).tolist()
    if too_short:
        raise ValueError("paged_attention: every seq_len must be >= 1")
    if too_long:
        raise ValueError(f"paged_attention: a seq_len exceeds the block table's capacity ({max_blocks} blocks x {block_size})")
    if outside:
        raise ValueError(f"paged_attention: the block table points outside the pool of {num_blocks} blocks")


def check_cache(op: str, q, k_cache, v_cache, q_layout: str, min_block_size: int) -> tuple[int, int]:
    """The checks every paged kernel makes on q (``q_layout``: its 3 dims' names) and the K/V pools; returns
    (num_blocks, block_size)."""
    check_tensors(op, q=q, k_cache=k_cache, v_cache=v_cache)
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be {q_layout}, got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache and v_cache must be (num_blocks, block_size, Hkv, D) and alike, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"{op}: q has head_dim {head_dim}, the cache {cache_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{op}: head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"{op}: {heads} query heads is not a multiple of {kv_heads} KV heads")
    if block_size < min_block_size or block_size & (block_size - 1):
        raise ValueError(f"{op}: block_size must be a power of two, at least {min_block_size}, got {block_size}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: k_cache and v_cache must be contiguous")
    return num_blocks, block_size


def check_int32_rows(op: str, device, **tensors: tuple) -> None:
    """Each of ``tensors`` (name=(tensor, dims, rows)) is an int32 tensor of that many dims and rows on ``device``."""
    for name, (t, ndim, rows) in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != ndim or t.shape[0] != rows:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{op}: {name} must be an int32 tensor with {ndim} dims and {rows} rows, got {got}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {device}")


def check_inputs(q, k_cache, v_cache, block_table, seq_lens, *, validate: bool = True) -> None:
    """Every check :func:`paged_attention` makes before launching; ``validate=False`` skips the two that read
    block_table and seq_lens on the device (see paged_attention)."""
    num_blocks, block_size = check_cache("paged_attention", q, k_cache, v_cache, "(B, H, D)", min_block_size=16)
    batch = q.shape[0]
    check_int32_rows("paged_attention", q.device, block_table=(block_table, 2, batch), seq_lens=(seq_lens, 1, batch))
    if validate:
        _check_tables(block_table, seq_lens, num_blocks, block_size)


def paged_attention_forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, sm_scale: float | None = None, num_splits: int | None = None,
    blocks_per_step: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """The launcher behind :func:`paged_attention` (same arguments, documented there): decode attention through block
    tables, launched directly, with no custom-op dispatch and no gradient check."""
    check_inputs(q, k_cache, v_cache, block_table, seq_lens, validate=validate)
    if blocks_per_step is not None and (blocks_per_step < 1 or blocks_per_step & (blocks_per_step - 1)):
        raise ValueError(f"paged_attention: blocks_per_step must be a power of two, got {blocks_per_step}")
    batch, heads, head_dim = q.shape
    if batch == 0:  # no sequence, nothing to launch: the empty output, as vLLM's kernel gives
        return torch.empty_like(q)
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    max_blocks = block_table.shape[1]

    splits = num_splits or num_splits_for(batch, kv_heads, max_blocks)
    blocks_per_split = max(1, math.ceil(max_blocks / splits))
    splits = max(1, math.ceil(max_blocks / blocks_per_split))
    partial_out = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    partial_max = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    config = split_config(head_dim, block_size, group, q.dtype)
    precise = q.dtype == torch.float32 and runtime.on_gpu()  # the interpreter's exp is NumPy's: precise already
    launch(
        _paged_attention_split_kernel, (batch, kv_heads, splits),
        q, k_cache, v_cache, block_table, seq_lens, partial_out, partial_max, partial_sum,
        sm_scale if sm_scale is not None else head_dim ** -0.5,
        q.stride(0), q.stride(1), block_table.stride(0), *k_cache.stride()[:3], splits, blocks_per_split,
        GROUP=group, BLOCK_G=_block_g(group), PAGE_SIZE=block_size,
        PAGES_PER_STEP=blocks_per_step or config["PAGES_PER_STEP"], HEAD_DIM=head_dim,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PRECISE_EXP=precise,
        num_warps=num_warps or config["num_warps"],
        **({} if num_stages is None else {"num_stages": num_stages}), **pdl_options(),
    )
    launch(
        _paged_attention_reduce_kernel, (batch * heads,),
        partial_out, partial_max, partial_sum, out, splits, BLOCK_S=next_power_of_2(splits), HEAD_DIM=head_dim,
        PRECISE_EXP=precise, num_warps=REDUCE_WARPS, **pdl_options(),
    )
    return out


# --- the op: torch.ops.lessonlib.paged_attention, with a fake implementation, no gradient -------------------------

@torch.library.custom_op("lessonlib::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    sm_scale: float | None, num_splits: int | None, blocks_per_step: int | None, num_warps: int | None,
    num_stages: int | None, validate: bool,
) -> torch.Tensor:
    return paged_attention_forward(q, k_cache, v_cache, block_table, seq_lens, sm_scale, num_splits, blocks_per_step,
                                   num_warps, num_stages, validate)


@_paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, sm_scale, num_splits, blocks_per_step, num_warps, num_stages,
      validate):
    check_inputs(q, k_cache, v_cache, block_table, seq_lens, validate=False)  # the table checks read values
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


_PAGED_ATTENTION = torch.ops.lessonlib.paged_attention.default


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, sm_scale: float | None = None, num_splits: int | None = None,
    blocks_per_step: int | None = None, num_warps: int | None = None, num_stages: int | None = None, validate: bool = True,
) -> torch.Tensor:
    """Decode attention through block tables, like ``lessonlib.reference.paged_attention``: the op a model calls.

    q: (B, H, D); k_cache, v_cache: (num_blocks, block_size, Hkv, D) with H a multiple of Hkv and block_size a
    power of two of at least 16; block_table: (B, max_blocks) int32; seq_lens: (B,) int32, each in [1, max_blocks * block_size].
    ``num_splits`` overrides the split count (see :func:`num_splits_for`); ``blocks_per_step``, ``num_warps`` and
    ``num_stages`` override :func:`split_config` (tuning knobs for benchmarks). ``validate=False`` skips the checks that read block_table and seq_lens (they
    cost a device sync per call, which a decode loop or a CUDA-graph capture cannot afford): only for tables built
    by a trusted source such as ``PagedKVCache.block_table``. Shapes, dtypes and devices are always checked.
    No backward: inputs that require grad are refused (outside ``torch.no_grad()``). Returns (B, H, D).
    """
    refuse_gradient("paged_attention", "it has no backward: a decode kernel for serving; train with flash_attention",
                    q=q, k_cache=k_cache, v_cache=v_cache)
    if torch.compiler.is_compiling():
        return _PAGED_ATTENTION(q, k_cache, v_cache, block_table, seq_lens, sm_scale, num_splits, blocks_per_step,
                                num_warps, num_stages, validate)
    return paged_attention_forward(q, k_cache, v_cache, block_table, seq_lens, sm_scale, num_splits, blocks_per_step,
                                   num_warps, num_stages, validate)
