"""Experiment (not a recorded benchmark): shorter decode attention in the batch-1 step, by loading earlier.

    python benchmarks/experiments/decode_attention_latency.py [--rounds 3] [--out FILE]

decode_step_profile.py found paged attention's two kernels the largest excess of the batch-1 step on both shapes
(5.1 µs a layer on the Llama-3.2-1B shape, 4.8 on Qwen2.5-0.5B's, for a few hundred KB of K/V): at that size a split
is a chain of dependent memory round trips after its ``gdc_wait`` (the sequence's length, then its block table, then
K/V, once per loop step, then the partial results), and the reduce is one more kernel boundary. Two changes, each
timed in the whole step (the fused engine's step captured in one CUDA graph, as bench_engine.py times it):

- **prefetch**: the split kernel loads, *before* its wait, what no kernel of a decode step writes: the length, the
  block table and the K/V of its first loop step, except the block that holds the newest token (the qkv kernel just
  before writes that token's K/V: those rows are loaded after the wait). The query comes after the wait as before.
- **last split reduces**: no reduce kernel; each split adds one to a counter of its (sequence, KV head) after storing
  its partial result, and the split that arrives last combines the partial results of that KV head's query heads
  (the reduce kernel's arithmetic) and sets the counter back to zero for the next call.

Each with paged_attention's own split count and with one cache block per split (every split's K/V then loaded before
the wait). Before timing, each variant is compared with the lesson kernel at the same split count (:func:`op_check`):
the op alone on random inputs, bit for bit for prefetch alone (the same arithmetic on the same values), within one
unit of the output dtype per element with the last split reducing (the same sums, perhaps in another order); and the
step's logits, bit for bit for prefetch alone (a stale K/V of the newest token would change them). A variant that
differs more is recorded and not timed. GPU only (the timing); the kernel itself runs anywhere, and tests/test_benchmarks.py checks it
against ops.paged_attention in the interpreter.

The prefetch is safe only where the caller can promise that no earlier kernel still running writes any K/V but the
newest token's, nor the length or the block table: true of the engine's decode step, not of paged_attention in
general (a prefill's store_kv, say, writes many slots): a library version would need that promise in its signature.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import gpu_experiment  # noqa: E402

from lessonlib import ops, runtime  # noqa: E402  (before triton: it chooses the interpreter on a CPU)
from lessonlib.ops._common import launch, next_power_of_2, pdl_options, pdl_wait_then_trigger  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

paged = importlib.import_module("lessonlib.ops.paged_attention")  # the module (lessonlib.ops exports the op)

CONTEXT = 128 + 128 // 2  # bench_engine.py's batch-1 step


@triton.jit
def _step_rows(table_row_ptr, logical, last, seq_len, j, d, kv_head, stride_cache_block, stride_cache_token,
               stride_cache_head, PAGE_SIZE: tl.constexpr):
    """The lesson kernel's gather for one loop step from cache block ``logical`` on: each row j's K/V offsets (token j
    lives in block table[logical + j // PAGE_SIZE]), which rows hold a token of the sequence inside the split (ends at
    block ``last``), and each row's logical block."""
    block_of_token = logical + j // PAGE_SIZE
    in_split = block_of_token < last
    physical = tl.load(table_row_ptr + block_of_token, mask=in_split, other=0).to(tl.int64)
    offsets = (physical * stride_cache_block + (j % PAGE_SIZE) * stride_cache_token)[:, None] \
        + kv_head * stride_cache_head + d[None, :]
    return offsets, in_split & ((logical * PAGE_SIZE + j) < seq_len), block_of_token


@triton.jit
def _split_prefetch_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,  # as paged_attention's split kernel
    partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    out_ptr,  # REDUCE_LAST: (B, H, D), the combined output
    counter_ptr,  # REDUCE_LAST: (B, Hkv) int32, zero between calls: splits of that KV head done so far
    sm_scale,
    stride_qb, stride_qh,
    stride_table_b,
    stride_cache_block, stride_cache_token, stride_cache_head,
    num_splits, blocks_per_split,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGES_PER_STEP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, INPUT_PRECISION: tl.constexpr, PRECISE_EXP: tl.constexpr,
    REDUCE_LAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP

    # Before the wait: what no kernel of a decode step writes.
    seq_len = tl.load(seq_lens_ptr + b)
    newest = (seq_len - 1) // PAGE_SIZE  # the block of the token whose K/V the kernel before writes
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, PAGE_SIZE))
    j = tl.arange(0, PAGES_PER_STEP * PAGE_SIZE)
    offsets, valid, block_of_token = _step_rows(block_table_ptr + b * stride_table_b, first, last, seq_len, j, d,
                                                kv_head, stride_cache_block, stride_cache_token, stride_cache_head,
                                                PAGE_SIZE)
    older = valid & (block_of_token != newest)
    k = tl.load(k_cache_ptr + offsets, mask=older[:, None], other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=older[:, None], other=0.0)

    pdl_wait_then_trigger(PDL)
    fresh = valid & (block_of_token == newest)
    k = tl.where(fresh[:, None], tl.load(k_cache_ptr + offsets, mask=fresh[:, None], other=0.0), k)
    v = tl.where(fresh[:, None], tl.load(v_cache_ptr + offsets, mask=fresh[:, None], other=0.0), v)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    if first < last:  # a split past the sequence's end folds nothing in (its max stays -inf, as the lesson kernel's)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m, l, acc = paged._online_softmax_step(m, l, acc, scores, v, PRECISE_EXP, INPUT_PRECISION)
    for logical in range(first + PAGES_PER_STEP, last, PAGES_PER_STEP):  # the lesson kernel's loop, from step 2
        offsets, valid, _ = _step_rows(block_table_ptr + b * stride_table_b, logical, last, seq_len, j, d, kv_head,
                                       stride_cache_block, stride_cache_token, stride_cache_head, PAGE_SIZE)
        k = tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m, l, acc = paged._online_softmax_step(m, l, acc, scores, v, PRECISE_EXP, INPUT_PRECISION)

    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
    tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])
    tl.store(partial_max_ptr + row, m, mask=g_mask)
    tl.store(partial_sum_ptr + row, l, mask=g_mask)
    if REDUCE_LAST:
        _last_split_reduces(partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, counter_ptr, b, kv_head,
                            tl.num_programs(1), d, num_splits, GROUP, HEAD_DIM, BLOCK_S, PRECISE_EXP)


@triton.jit
def _last_split_reduces(partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, counter_ptr, b, kv_head, kv_heads,
                        d, num_splits, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                        PRECISE_EXP: tl.constexpr):
    """After a split stored its partial results: count it; the split that arrives last for its (sequence, KV head)
    combines the partial results of that KV head's query heads (the reduce kernel's arithmetic) and sets the count
    back to zero for the next call."""
    tl.debug_barrier()  # every thread's partial results stored before the count says so
    count_at = counter_ptr + b * kv_heads + kv_head
    arrived = tl.atomic_add(count_at, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        tl.atomic_xchg(count_at, 0, sem="relaxed", scope="gpu")
        s = tl.arange(0, BLOCK_S)
        s_mask = s < num_splits
        for gi in tl.static_range(GROUP):
            head = b * kv_heads * GROUP + kv_head * GROUP + gi
            at = head * num_splits  # (b, head)'s first split; loads from the L2: other programs wrote them
            m_s = tl.load(partial_max_ptr + at + s, mask=s_mask, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(partial_sum_ptr + at + s, mask=s_mask, other=0.0, cache_modifier=".cg")
            acc_s = tl.load(partial_out_ptr + (at + s)[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None],
                            other=0.0, cache_modifier=".cg")
            m_all = tl.max(m_s, axis=0)
            weight = tl.where(m_s > float("-inf"), paged._exp(m_s - m_all, PRECISE_EXP), 0.0)
            o = tl.sum(acc_s * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
            tl.store(out_ptr + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty))


def attention(q, k_cache, v_cache, block_table, seq_lens, *, num_splits: int | None = None,
              reduce_last: bool = False, counter: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention_forward's launch with the prefetching split kernel (and, with ``reduce_last``, no reduce
    kernel: ``counter`` (B, Hkv) int32 zeros, left at zero). No input checks beyond ops.paged_attention's."""
    paged.check_inputs(q, k_cache, v_cache, block_table, seq_lens, validate=False)
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    max_blocks = block_table.shape[1]
    splits = num_splits or paged.num_splits_for(batch, kv_heads, max_blocks)
    blocks_per_split = max(1, math.ceil(max_blocks / splits))
    splits = max(1, math.ceil(max_blocks / blocks_per_split))
    if reduce_last and (counter is None or tuple(counter.shape) != (batch, kv_heads) or counter.dtype != torch.int32):
        raise ValueError(f"reduce_last needs a ({batch}, {kv_heads}) int32 counter of zeros")
    partial_out = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    partial_max = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    config = paged.split_config(head_dim, block_size, group, q.dtype)
    precise = q.dtype == torch.float32 and runtime.on_gpu()
    launch(_split_prefetch_kernel, (batch, kv_heads, splits),
           q, k_cache, v_cache, block_table, seq_lens, partial_out, partial_max, partial_sum, out,
           counter if reduce_last else seq_lens, head_dim ** -0.5,
           q.stride(0), q.stride(1), block_table.stride(0), *k_cache.stride()[:3], splits, blocks_per_split,
           GROUP=group, BLOCK_G=paged._block_g(group), PAGE_SIZE=block_size, PAGES_PER_STEP=config["PAGES_PER_STEP"],
           HEAD_DIM=head_dim, BLOCK_S=next_power_of_2(splits),
           INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PRECISE_EXP=precise,
           REDUCE_LAST=reduce_last, num_warps=config["num_warps"], **pdl_options())
    if not reduce_last:
        launch(paged._paged_attention_reduce_kernel, (batch * heads,),
               partial_out, partial_max, partial_sum, out, splits, BLOCK_S=next_power_of_2(splits),
               HEAD_DIM=head_dim, PRECISE_EXP=precise, num_warps=paged.REDUCE_WARPS, **pdl_options())
    return out


def op_check(config, max_blocks: int, splits: int | None, reduce_last: bool, counter: torch.Tensor,
             dtype: torch.dtype, context: int) -> float:
    """The variant against ops.paged_attention at the same split count, at the step's shapes (random K/V and
    query, the context's blocks scattered over the pool): the largest difference in units of the output dtype (its
    spacing at each element). The prefetch must give 0 (the same arithmetic on the same values); with the last split
    reducing, at most 1 (the reduce's float32 sums, perhaps in another order, rounded once to the dtype)."""
    heads, kv_heads, head_dim, block_size = config.num_heads, config.num_kv_heads, config.head_dim, 16
    pool = max_blocks + 7
    device = counter.device
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(1, heads, head_dim, device=device, dtype=dtype)
    table = torch.randperm(pool, device=device)[:max_blocks].to(torch.int32)[None, :]
    seq_lens = torch.tensor([context], device=device, dtype=torch.int32)
    want = ops.paged_attention(q, k_cache, v_cache, table, seq_lens, num_splits=splits)
    got = attention(q, k_cache, v_cache, table, seq_lens, num_splits=splits, reduce_last=reduce_last,
                    counter=counter)
    if reduce_last and counter.any():
        return math.inf  # the last split did not set its counter back
    return units(got, want)


def check_and_time(step, truth: dict, label: str, reduce_last: bool | None, worst: float, limit_us: float | None,
                   timed: bool) -> dict:
    """Run the step with the variant in place, compare (see the module's docstring), time it in a CUDA graph if it
    agrees and ``timed``. The lesson kernel's run (``reduce_last`` None) becomes ``truth[label]``."""
    from lessonlib.measure import time_graph

    logits = step().clone()
    if reduce_last is None:
        truth[label] = logits
    # prefetch alone: the step's logits bit for bit (a stale K/V of the newest token, read before the qkv kernel
    # wrote it, would change them); the last split reducing may move an attention output by one unit, which the
    # layers after it carry on: reported, not gated
    same_logits = torch.equal(logits, truth[label])
    agrees = (worst == 0 and same_logits) if reduce_last is not True else worst <= 1
    agrees = agrees and bool(logits.isfinite().all())
    row = {"agrees": agrees, "op_worst_difference_in_units": round(worst, 3), "step_logits_equal": same_logits,
           "step_logits_largest_difference": (logits - truth[label]).abs().max().item()}
    if agrees and timed:
        us = time_graph(step).median_us
        row.update({"gpu_us": round(us, 1), "limit_us": round(limit_us, 1), "fraction_of_limit": round(limit_us / us, 3)})
    return row


def fused_engine(path: Path, dtype: torch.dtype, context: int, bandwidth: float | None):
    """(engine, its ModelConfig, the step's bytes-read limit in µs or None): an engine with
    ``Features(fused_decode_layer=True)`` and bench_engine.py's table width (its prompt 128 + 128 new tokens + 16),
    and the limit as bench_engine.py computes it (weights plus the context's K/V at ``bandwidth``)."""
    from lessonlib.engine import LLM, Features, ModelConfig

    config = ModelConfig.from_folder(path)
    element = torch.empty((), dtype=dtype).element_size()
    limit_us = (config.weight_bytes(element) + 2 * context * config.num_layers * config.num_kv_heads
                * config.head_dim * element) / bandwidth * 1e6 if bandwidth else None
    llm = LLM(path, dtype=dtype, max_num_seqs=1, max_model_len=context + 128 // 2 + 16,
              features=Features(fused_decode_layer=True))
    return llm, config, limit_us


def run_shape(name: str, path: Path, dtype: torch.dtype, context: int, rounds: int, bandwidth: float | None) -> list:
    """Every variant on one engine (``Features(fused_decode_layer=True)``), ``rounds`` times, interleaved."""
    from lessonlib.engine.model import EngineLayer

    import bench_engine

    llm, config, limit_us = fused_engine(path, dtype, context, bandwidth)
    model, k_caches, v_caches, max_blocks = llm.model, llm.runner.k_caches, llm.runner.v_caches, llm.runner.max_blocks
    counter = torch.zeros(1, config.num_kv_heads, dtype=torch.int32, device=llm.runner.device)
    own = paged.num_splits_for(1, config.num_kv_heads, max_blocks)
    variants = {}
    for splits, label in ((None, f"paged_attention's split count ({own})"),
                          (max_blocks, f"one block a split ({max_blocks})")):
        variants |= {("lesson kernel", label): (splits, None), ("prefetch", label): (splits, False),
                     ("prefetch, last split reduces", label): (splits, True)}
    lesson_attention, rows, truth = EngineLayer.decode_attention, [], {}
    try:
        with bench_engine.decode_inputs(llm, 1, context) as (ctx, ids, positions), torch.inference_mode():
            step = lambda: model.logits(model(ids, positions, ctx, k_caches, v_caches))  # noqa: E731
            for round_ in range(rounds):
                for (kernel, label), (splits, reduce_last) in variants.items():
                    ctx.decode_splits = splits
                    EngineLayer.decode_attention = lesson_attention if reduce_last is None else (
                        lambda self, q, c, k, v, r=reduce_last: attention(
                            q, k, v, c.block_table, c.seq_lens, num_splits=c.decode_splits, reduce_last=r,
                            counter=counter))
                    row = {"shape": name, "kernel": kernel, "splits": label, "round": round_ + 1}
                    try:
                        worst = 0.0 if reduce_last is None else op_check(
                            config, max_blocks, splits, reduce_last, counter, dtype, context)
                        row |= check_and_time(step, truth, label, reduce_last, worst, limit_us, bandwidth is not None)
                        print(f"{name:14s} {kernel:30s} {label:32s} round {round_ + 1}: " + (
                            f"DIFFERS (op {worst:.3g} units, logits equal: {row['step_logits_equal']}): not timed"
                            if not row["agrees"] else f"{row['gpu_us']:7.1f} us ({row['fraction_of_limit']:.3f})"
                            if "gpu_us" in row else "agrees"), flush=True)
                    except Exception as error:  # a compile error: recorded, the others still timed
                        row["error"] = f"{type(error).__name__}: {error}"[:2000]
                        print(f"{name} {kernel} {label}: {row['error'][:300]}", flush=True)
                    rows.append(row)
    finally:
        EngineLayer.decode_attention = lesson_attention
    return rows


def step_experiment(script: str, description: str, run_shape) -> None:
    """The command line of an experiment on the fused batch-1 step (this one and decode_qkv_attention.py):
    ``run_shape(name, checkpoint path, dtype, context, rounds, bandwidth or None)`` gives each shape's rows, on
    bench_engine.py's two shapes (``--smoke``: a tiny model in the interpreter, one round, nothing timed)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model, one round, every check, nothing timed: runs anywhere (the interpreter)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not (runtime.on_gpu() or args.smoke):
        sys.exit(f"{script} times CUDA graphs: it needs a GPU (or --smoke)")
    import bench_engine
    from lessonlib.measure import measure_ceilings, warm_up_gpu

    dtype = runtime.dtype()
    bandwidth = None
    if not args.smoke:
        warm_up_gpu()
        bandwidth = measure_ceilings().bandwidth_gbs * 1e9
    shapes = ({"tiny": (bench_engine.TINY, "Llama")} if args.smoke else
              {"Llama-3.2-1B": (bench_engine.LLAMA_1B, "Llama"), "Qwen2.5-0.5B": (bench_engine.QWEN_05B, "Qwen2")})
    context = 40 if args.smoke else CONTEXT
    rows = []
    for name, path in bench_engine.each_checkpoint(shapes, dtype, Path(script).stem + "-"):
        rows += run_shape(name, path, dtype, context, 1 if args.smoke else args.rounds, bandwidth)
    command = f"python benchmarks/experiments/{script} " + ("--smoke" if args.smoke else f"--rounds {args.rounds}")
    gpu_experiment.write_results(args.out, command, bandwidth, rows, context=context)


def units(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference between two tensors of one dtype, in units of that dtype at each of ``want``'s elements
    (its spacing there, roughly: eps x |value|)."""
    finfo = torch.finfo(want.dtype)
    spacing = finfo.eps * want.float().abs().clamp_min(finfo.tiny)
    return ((got.float() - want.float()).abs() / spacing).max().item()


if __name__ == "__main__":
    step_experiment("decode_attention_latency.py", __doc__.split("\n\n")[0], run_shape)
