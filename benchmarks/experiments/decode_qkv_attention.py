"""Experiment (not a recorded benchmark): the batch-1 decode layer in four kernels, attention inside the qkv kernel.

    python benchmarks/experiments/decode_qkv_attention.py [--rounds 3] [--smoke] [--out FILE]

Of a decode layer's dependencies only four are all-to-all (every output reads the whole input: x -> qkv, attention
-> o, o -> gate_up, gate_up -> down); attention reads only its own KV head's q, k and v. So the qkv kernel
(``ops.decode_qkv_rope_store_kv``: RMSNorm, the product, RoPE, the K/V write) can run the attention too: each program
adds one to its KV head's counter after storing its columns (a program's pairs all lie in one head), and the program
that arrives last for a KV head (GROUP query heads, its k and its v: every column that attention reads) runs that
head's attention over the whole context, one split, reading q and the new K/V from the L2, and writes the
attention output; it sets the counter back to zero for the next call. The layer is then K1 qkv + attention, K4 o +
residual, K5 gate_up, K6 down: four kernels, one boundary fewer than paged attention's split and reduce leave.

The cost: one program per KV head walks the whole context after the qkv product, so this suits short contexts (the
benchmark's 192 tokens: 12 cache blocks), not long ones (a library version would keep paged attention's splits past
some length). Timed in the whole step (bench_engine.py's fused batch-1 step in one CUDA graph), beside the fused
engine at paged_attention's own split count and at one split, whose arithmetic this kernel repeats: before timing,
its op output (q, the K/V written, the attention output) is compared with ``decode_qkv_rope_store_kv`` then
``paged_attention(num_splits=1)`` (bit for bit in the interpreter; within one unit of the dtype per element on a
GPU), and the step's logits with the one-split engine's. ``--smoke``: a tiny model in the interpreter, nothing timed.

The product's code is ``ops.decode_gemv``'s kernel for the RoPE epilogue and one row, repeated here rather than
shared: the library kernel stays as it is until a measurement says this wins.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lessonlib import ops, runtime  # noqa: E402  (before triton: it chooses the interpreter on a CPU)
from lessonlib.ops._common import cdiv, gdc_launch_dependents, gdc_wait, launch, pdl_options  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from decode_attention_latency import fused_engine, step_experiment, units  # noqa: E402

dg = importlib.import_module("lessonlib.ops.decode_gemv")  # the modules (lessonlib.ops exports the ops)
paged = importlib.import_module("lessonlib.ops.paged_attention")


@triton.jit
def _qkv_pairs(x_ptr, norm_ptr, w_ptr, bias_ptr, pairs, ok, K, stride_wn, eps, half, NORM: tl.constexpr,
               HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """decode_gemv's kernel for the RoPE epilogue, one row: each pair's columns i and i + D/2 of its head, normed
    input, float32 sums (+ bias). Returns the two sums."""
    ks = tl.arange(0, BLOCK_K)
    col_a = (pairs // half) * 2 * half + pairs % half
    col_b = col_a + half
    w_a = w_ptr + col_a[:, None].to(tl.int64) * stride_wn + ks[None, :]
    w_b = w_ptr + col_b[:, None].to(tl.int64) * stride_wn + ks[None, :]
    w_mask = ok[:, None] if EVEN_K else ok[:, None] & (ks[None, :] < K)
    wa = tl.load(w_a, mask=w_mask, other=0.0)
    wb = tl.load(w_b, mask=w_mask, other=0.0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    dtype = x_ptr.dtype.element_ty
    x = dg._load_x(x_ptr, 0, ks, K, EVEN_K)
    rstd = 1.0
    if NORM:
        rstd = dg._row_rstd(x_ptr, x, ks, K, eps, BLOCK_K)
        x = dg._normed(x, norm_ptr, 0, ks, K, rstd, dtype)
    acc_a = tl.sum(wa.to(tl.float32) * x[None, :], axis=1)
    acc_b = tl.sum(wb.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = dg._load_x(x_ptr, k0, ks, K, EVEN_K)
        if NORM:
            x = dg._normed(x, norm_ptr, k0, ks, K, rstd, dtype)
        tile_mask = w_mask if EVEN_K else ok[:, None] & (k0 + ks < K)[None, :]
        acc_a += tl.sum(tl.load(w_a + k0, mask=tile_mask, other=0.0).to(tl.float32) * x[None, :], axis=1)
        acc_b += tl.sum(tl.load(w_b + k0, mask=tile_mask, other=0.0).to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc_a += tl.load(bias_ptr + col_a, mask=ok, other=0.0).to(tl.float32)
        acc_b += tl.load(bias_ptr + col_b, mask=ok, other=0.0).to(tl.float32)
    return acc_a, acc_b


@triton.jit
def _head_attention(q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, seq_len, out_ptr, kv_head, sm_scale,
                    stride_cache_block, stride_cache_token, stride_cache_head, GROUP: tl.constexpr,
                    BLOCK_G: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGES_PER_STEP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_EXP: tl.constexpr):
    """paged attention's split kernel with one split, then its reduce (acc / l), for one KV head's query heads of
    the one sequence. q and the newest K/V were just written by other programs: every load goes to the L2."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + heads[:, None] * HEAD_DIM + d[None, :], mask=g_mask[:, None], other=0.0,
                cache_modifier=".cg")
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    last = tl.cdiv(seq_len, PAGE_SIZE)
    j = tl.arange(0, PAGES_PER_STEP * PAGE_SIZE)
    for logical in range(0, last, PAGES_PER_STEP):
        block_of_token = logical + j // PAGE_SIZE
        in_split = block_of_token < last
        physical = tl.load(table_row_ptr + block_of_token, mask=in_split, other=0).to(tl.int64)
        offsets = (physical * stride_cache_block + (j % PAGE_SIZE) * stride_cache_token)[:, None] \
            + kv_head * stride_cache_head + d[None, :]
        valid = in_split & ((logical * PAGE_SIZE + j) < seq_len)
        k = tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        v = tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m, l, acc = paged._online_softmax_step(m, l, acc, scores, v, PRECISE_EXP, INPUT_PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + heads[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _qkv_attention_kernel(
    x_ptr, norm_ptr, w_ptr, bias_ptr,  # as decode_gemv's, one row: x (1, K)
    q_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, slots_ptr,  # as its RoPE epilogue's
    block_table_ptr, seq_lens_ptr,  # (1, max_blocks) int32, (1,) int32: the sequence, its new token included
    out_ptr,  # (1, H, D): the attention output
    counter_ptr,  # (Hkv,) int32, zero between calls: programs of that KV head's columns done so far
    n_out, K, stride_wn, eps, sm_scale, half, q_cols, kv_cols,
    stride_cache_block, stride_cache_token, stride_cache_head,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGES_PER_STEP: tl.constexpr,
    HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_EXP: tl.constexpr,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program n: pairs [n * BLOCK_N, (n + 1) * BLOCK_N), all in one head (BLOCK_N divides D/2)."""
    pid = tl.program_id(0)
    pairs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = pairs < n_out
    acc_a, acc_b = _qkv_pairs(x_ptr, norm_ptr, w_ptr, bias_ptr, pairs, ok, K, stride_wn, eps, half, NORM, HAS_BIAS,
                              BLOCK_K, EVEN_K, PDL)
    dtype = x_ptr.dtype.element_ty
    dg._rope_kv_epilogue(acc_a.to(dtype).to(tl.float32), acc_b.to(dtype).to(tl.float32), pairs, ok, 0, half, q_cols,
                         kv_cols, q_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, slots_ptr, 0, 0)
    heads, kv_heads = q_cols // (2 * half), kv_cols // (2 * half)
    head = (pid * BLOCK_N) // half  # q's heads, then k's, then v's
    kv_head = tl.where(head < heads, head // GROUP, tl.where(head < heads + kv_heads, head - heads,
                                                              head - heads - kv_heads))
    tl.debug_barrier()  # every thread's q, k, v stored before the count says so
    arrived = tl.atomic_add(counter_ptr + kv_head, 1, sem="acq_rel", scope="gpu")
    if arrived == (GROUP + 2) * (half // BLOCK_N) - 1:  # the last of its KV head's programs: q, k and v are in
        tl.atomic_xchg(counter_ptr + kv_head, 0, sem="relaxed", scope="gpu")
        _head_attention(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, tl.load(seq_lens_ptr), out_ptr, kv_head,
                        sm_scale, stride_cache_block, stride_cache_token, stride_cache_head, GROUP, BLOCK_G,
                        PAGE_SIZE, PAGES_PER_STEP, HEAD_DIM, INPUT_PRECISION, PRECISE_EXP)


def qkv_attention(x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, slots, block_table, seq_lens, *,
                  num_heads: int, num_kv_heads: int, eps: float, counter: torch.Tensor) -> tuple:
    """``ops.decode_qkv_rope_store_kv(...)`` then ``ops.paged_attention(q, ..., num_splits=1)`` in one launch, for one
    sequence (x (1, K)); ``counter``: (Hkv,) int32 zeros, left at zero. Returns (q, attention output), (1, H, D)
    each. Checks only what the two ops' checks do not: one row, a counter of the right shape."""
    if x.shape[0] != 1 or block_table.shape[0] != 1:
        raise ValueError("qkv_attention: one sequence, one new token")
    if tuple(counter.shape) != (num_kv_heads,) or counter.dtype != torch.int32:
        raise ValueError(f"qkv_attention: counter must be ({num_kv_heads},) int32 zeros")
    head_dim, block_size = k_cache.shape[-1], k_cache.shape[1]
    half, width = head_dim // 2, (num_heads + 2 * num_kv_heads) * head_dim
    q = torch.empty(1, num_heads, head_dim, dtype=x.dtype, device=x.device)
    out = torch.empty_like(q)
    meta = dg.config(width // 2, x.shape[1], dg.ROPE_KV)
    meta["BLOCK_N"] = min(meta["BLOCK_N"], half)  # a program's pairs in one head: both powers of two
    group = num_heads // num_kv_heads
    attention = paged.split_config(head_dim, block_size, group, x.dtype)
    launch(_qkv_attention_kernel, (cdiv(width // 2, meta["BLOCK_N"]),),
           x, norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
           q, k_cache, v_cache, cos, sin, slots, block_table, seq_lens, out, counter,
           width // 2, x.shape[1], weight.stride(0), float(eps), head_dim ** -0.5, half, num_heads * head_dim,
           num_kv_heads * head_dim, *k_cache.stride()[:3],
           GROUP=group, BLOCK_G=paged._block_g(group), PAGE_SIZE=block_size,
           PAGES_PER_STEP=attention["PAGES_PER_STEP"], HEAD_DIM=head_dim,
           INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
           PRECISE_EXP=x.dtype == torch.float32 and runtime.on_gpu(), NORM=norm_weight is not None,
           HAS_BIAS=bias is not None, EVEN_K=x.shape[1] % meta["BLOCK_K"] == 0, **meta, **pdl_options())
    return q, out


def op_check(heads: int, kv_heads: int, head_dim: int, hidden: int, max_blocks: int, context: int,
             dtype: torch.dtype, device) -> float:
    """:func:`qkv_attention` against ``decode_qkv_rope_store_kv`` then ``paged_attention(num_splits=1)`` on random
    inputs (bias and norm included, the sequence's blocks scattered over the pool): the largest difference, in units
    of the dtype at each element, over q, the pools after the K/V write, and the attention output."""
    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    width = (heads + 2 * kv_heads) * head_dim
    x, weight, bias, norm = randn(1, hidden), randn(width, hidden) / hidden ** 0.5, randn(width), randn(hidden)
    angles = randn(1, head_dim // 2).float().repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    pool = max_blocks + 5
    caches = [randn(pool, 16, kv_heads, head_dim) for _ in range(4)]
    caches[2].copy_(caches[0])
    caches[3].copy_(caches[1])
    table = torch.randperm(pool, device=device)[:max_blocks].to(torch.int32)[None, :]
    slot = table[0, (context - 1) // 16].long() * 16 + (context - 1) % 16
    seq_lens = torch.tensor([context], device=device, dtype=torch.int32)
    counter = torch.zeros(kv_heads, dtype=torch.int32, device=device)
    shapes = dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-5)
    q_want = ops.decode_qkv_rope_store_kv(x, weight, bias, norm, cos, sin, caches[0], caches[1], slot[None], **shapes)
    want = ops.paged_attention(q_want, caches[0], caches[1], table, seq_lens, num_splits=1)
    q_got, got = qkv_attention(x, weight, bias, norm, cos, sin, caches[2], caches[3], slot[None], table, seq_lens,
                               **shapes, counter=counter)
    if counter.any():
        return float("inf")  # a counter not set back
    return max(units(q_got, q_want), units(caches[2], caches[0]), units(caches[3], caches[1]), units(got, want))


def run_shape(name: str, path: Path, dtype: torch.dtype, context: int, rounds: int, bandwidth: float | None) -> list:
    """The fused engine at paged_attention's own split count, at one split, and with :func:`qkv_attention`, on one
    engine, ``rounds`` times interleaved: checked, then timed where ``bandwidth`` is given (a GPU)."""
    import bench_engine
    from lessonlib.engine.model import EngineLayer
    from lessonlib.measure import time_graph

    llm, config, limit_us = fused_engine(path, dtype, context, bandwidth)
    model, k_caches, v_caches, max_blocks = llm.model, llm.runner.k_caches, llm.runner.v_caches, llm.runner.max_blocks
    counter = torch.zeros(config.num_kv_heads, dtype=torch.int32, device=llm.runner.device)
    worst = op_check(config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size, max_blocks, context,
                     dtype, llm.runner.device)
    lesson_layer = EngineLayer.fused_decode

    def four_kernels(self, stream, cos, sin, ctx, k_cache, v_cache):
        _, out = qkv_attention(stream, self.qkv_proj.weight, self.qkv_proj.bias, self.input_norm, cos, sin, k_cache,
                               v_cache, ctx.slots, ctx.block_table, ctx.seq_lens, num_heads=self.heads,
                               num_kv_heads=self.kv_heads, eps=self.eps, counter=counter)
        ops.decode_gemv(out.reshape(1, -1), self.o_proj.weight, self.o_proj.bias, residual=stream)
        act = ops.decode_gemv(stream, self.gate_up_proj.weight, norm_weight=self.post_attention_norm, eps=self.eps,
                              activation="swiglu")
        ops.decode_gemv(act, self.down_proj.weight, residual=stream)

    own = paged.num_splits_for(1, config.num_kv_heads, max_blocks)
    variants = {f"six kernels, paged_attention's split count ({own})": (None, lesson_layer),
                "six kernels, one split": (1, lesson_layer), "four kernels, attention in the qkv kernel": (1, four_kernels)}
    rows = []
    try:
        with bench_engine.decode_inputs(llm, 1, context) as (ctx, ids, positions), torch.inference_mode():
            step = lambda: model.logits(model(ids, positions, ctx, k_caches, v_caches))  # noqa: E731
            for round_ in range(rounds):
                truth = None
                for label, (splits, layer) in variants.items():
                    ctx.decode_splits, EngineLayer.fused_decode = splits, layer
                    logits = step().clone()
                    truth = logits if splits == 1 and layer is lesson_layer else truth
                    row = {"shape": name, "layer": label, "round": round_ + 1}
                    if layer is four_kernels:  # a race would show as an op difference or a step that differs
                        row |= {"op_worst_difference_in_units": round(worst, 3),
                                "step_logits_equal": torch.equal(logits, truth),
                                "step_logits_largest_difference": (logits - truth).abs().max().item()}
                        row["agrees"] = worst <= 1 and bool(logits.isfinite().all())
                    if row.get("agrees", True) and bandwidth:
                        us = time_graph(step).median_us
                        row |= {"gpu_us": round(us, 1), "limit_us": round(limit_us, 1),
                                "fraction_of_limit": round(limit_us / us, 3)}
                    print(f"{name:14s} {label:44s} round {round_ + 1}: {row.get('gpu_us', '-')} us "
                          f"{'' if row.get('agrees', True) else 'DIFFERS: not timed'}", flush=True)
                    rows.append(row)
    finally:
        EngineLayer.fused_decode = lesson_layer
    return rows


if __name__ == "__main__":
    step_experiment("decode_qkv_attention.py", __doc__.split("\n\n")[0], run_shape)
