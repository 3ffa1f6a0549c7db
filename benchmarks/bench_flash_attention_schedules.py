"""Lesson 02's second benchmark (issue 27): what the techniques of the fastest Hopper attention kernels buy a Triton
kernel, each measured beside cuDNN and lessonlib's own kernels in the same run.

    python -m benchmarks.bench_flash_attention_schedules --out lessonlib/results/flash-attention-schedules-h200.json

At the headline shape, B2 H32 N4096 D128, bf16 (TFLOP/s as in bench_flash_attention.py: 4·B·H·N²·D for the forward,
halved when causal, 2.5 times that for the backward):

Forward, non-causal: lessonlib's loop (online softmax, exp2, whole tiles) reading its tiles through **tensor
descriptors** (TMA: the Tensor Memory Accelerator copies a whole tile into shared memory, one instruction, no
address arithmetic in the threads), then the same with **warp specialization** (``tl.range(...,
warp_specialize=True)``: Triton splits the loop into producer warps that issue the copies and consumer warps that
compute), then a **persistent grid** (one program per multiprocessor walking the (query tile, head) tiles in turn,
head by head, so programs at work together share K and V in L2). Each at a few tile configurations.

Backward, full and causal: lessonlib's **two kernels** (dK and dV per key tile, then dQ per query tile: Q, dO and
the scores are loaded and recomputed in both) at its default tiles and at larger ones, against **one kernel** per
key tile that also adds its share of dQ into a float32 buffer with **atomics** (FlashAttention-2's original
schedule: each product computed once, at the price of BLOCK_M x D atomic adds per step).

Peers in the same run: SDPA forced onto cuDNN and onto FlashAttention-2, lessonlib's op (forward; backward through
autograd, as bench_flash_attention.py times it). Every configuration is recorded (``tiles``: BLOCK_M, BLOCK_N,
warps, stages); one Triton cannot compile or fit is recorded with its error. Each result is first checked against
float32 SDPA on the same inputs: its largest error must be within twice lessonlib's own kernel's (another order of
float32 sums moves the error a little; a wrong kernel is off by far more), or it is recorded as wrong, untimed.
``--smoke`` runs tiny sizes in any mode.
"""

from __future__ import annotations

import importlib


import torch

from lessonlib import bench, runtime

runtime.mode()  # chosen before the kernels below are defined
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lessonlib.cases.flash_attention import backward_of, forward_flops, peers
from lessonlib.measure import time_fn, warm_up_gpu
from lessonlib.ops._flash_attention_forward import LOG2E
from lessonlib.results import Benchmark, Impl, Op

fa = importlib.import_module("lessonlib.ops.flash_attention")  # the module (lessonlib.ops.flash_attention is the op)

SHAPE, SMOKE_SHAPE = (2, 32, 4096, 128), (2, 1, 32, 16)  # B, H, N, D
# (BLOCK_M, BLOCK_N, warps, stages)
FORWARD_TILES = ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3))
TWO_KERNEL_TILES = ((32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3))
ATOMIC_TILES = ((32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2))
SMOKE_FORWARD_TILES, SMOKE_BACKWARD_TILES = ((16, 16, 1, 1),), ((16, 16, 1, 1), (16, 32, 1, 1))
FORWARDS = {Impl.TMA_DESCRIPTORS: (False, False), Impl.TMA_WARP_SPECIALIZED: (True, False),
            Impl.TMA_PERSISTENT: (False, True)}  # impl -> (warp_specialize, persistent)


# --- the forward through tensor descriptors ------------------------------------------------------------------

@triton.jit
def _tma_forward_kernel(desc_q, desc_k, desc_v, desc_o, n_ctx, n_tiles, qk_scale, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """lessonlib's loop (non-causal, whole tiles), every tile fetched through a tensor descriptor. Query tile t is
    rows [t * BLOCK_M, (t + 1) * BLOCK_M) of the (B*H*N, D) views; program p takes tiles p, p + programs, ...: one
    tile each on lessonlib's grid (a program per tile), several on a persistent grid (a program per multiprocessor,
    the programs at work together on query tiles of one or two heads, whose K and V stay in L2)."""
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        row = tile * BLOCK_M
        head_start = row // n_ctx * n_ctx
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        q = desc_q.load([row, 0])
        for start_n in tl.range(0, n_ctx, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            k = desc_k.load([head_start + start_n, 0]).T
            qk = tl.dot(q, k)
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = desc_v.load([head_start + start_n, 0])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_ij
        desc_o.store([row, 0], (acc / l_i[:, None]).to(desc_o.dtype))


def tma_forward(q, k, v, tiles, warp_specialize, persistent):
    """Non-causal attention of contiguous (B, H, N, D) q, k, v, N a multiple of both tiles."""
    batch, heads, n, head_dim = q.shape
    block_m, block_n, warps, stages = tiles
    out = torch.empty_like(q)
    rows = batch * heads * n

    def descriptor(t, block):
        return TensorDescriptor(t.view(rows, head_dim), shape=[rows, head_dim], strides=[head_dim, 1],
                                block_shape=[block, head_dim])

    descriptors = (descriptor(q, block_m), descriptor(k, block_n), descriptor(v, block_n), descriptor(out, block_m))
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, WARP_SPECIALIZE=warp_specialize,
                num_warps=warps, num_stages=stages)
    qk_scale = head_dim ** -0.5 * LOG2E.value  # a float: LOG2E is a tl.constexpr, which a launch would compile in
    n_tiles = rows // block_m
    programs = min(n_tiles, runtime.gpu_profile().multiprocessors if runtime.on_gpu() else 3) if persistent else n_tiles
    _tma_forward_kernel[(programs,)](*descriptors, n, n_tiles, qk_scale, **meta)
    return out


# --- the backward in one kernel, dQ by atomics ---------------------------------------------------------------

@triton.jit
def _dkdv_atomic_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_ptr,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    heads, kv_heads, n_q, n_kv, sm_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """lessonlib's dK/dV kernel, plus each step's share of dQ, dSᵀ·K, added into the float32 dq (contiguous)."""
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
    if CAUSAL:
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
    q_tile = tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    do_tile = tl.arange(0, BLOCK_M)[:, None] * stride_dom + offs_d[None, :]
    dq_tile = tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + offs_d[None, :]
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_base = q_ptr + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
        do_base = do_ptr + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
        row_base = (batch * heads + head).to(tl.int64) * n_q
        dq_base = dq_ptr + row_base * HEAD_DIM
        offs_m = lo + tl.arange(0, BLOCK_M)
        for start_m in range(lo, n_q, BLOCK_M):
            m_ok = offs_m < n_q
            q = tl.load(q_base + tl.cast(start_m, tl.int64) * stride_qm + q_tile, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_base + tl.cast(start_m, tl.int64) * stride_dom + do_tile, mask=m_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + row_base + offs_m, mask=m_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + row_base + offs_m, mask=m_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q)) * qk_scale
            visible = n_ok[:, None] & m_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + causal_offset)
            p_t = tl.where(visible, tl.math.exp2(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
            dk += tl.dot(ds_t, q)
            dq = tl.dot(tl.trans(ds_t), k) * sm_scale  # (BLOCK_M, HEAD_DIM): this key tile's share
            tl.atomic_add(dq_base + tl.cast(start_m, tl.int64) * HEAD_DIM + dq_tile, dq, mask=m_ok[:, None],
                          sem="relaxed")
            offs_m += BLOCK_M
    dk *= sm_scale
    out_offsets = ((batch * kv_heads + kv_head).to(tl.int64) * n_kv * HEAD_DIM + offs_n[:, None] * HEAD_DIM
                   + offs_d[None, :])
    tl.store(dk_ptr + out_offsets, dk.to(dk_ptr.dtype.element_ty), mask=n_ok[:, None])
    tl.store(dv_ptr + out_offsets, dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None])


def atomic_backward(q, k, v, out, lse, grad_out, causal, sm_scale, tiles):
    """(dQ, dK, dV) in one kernel per key tile (plus dQ's zeroing and its conversion at the end, both timed)."""
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_kv = k.shape[1], k.shape[2]
    block_m, block_n, warps, stages = tiles
    delta = (grad_out.float() * out.float()).sum(-1)
    dq = torch.zeros(batch, heads, n_q, head_dim, dtype=torch.float32, device=q.device)
    dk = torch.empty(batch, kv_heads, n_kv, head_dim, dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2))
    _dkdv_atomic_dq_kernel[(triton.cdiv(n_kv, block_n), batch * kv_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, dq, *strides, heads, kv_heads, n_q, n_kv, sm_scale,
        GROUP=heads // kv_heads, CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return dq.to(q.dtype), dk, dv


def two_kernel_backward(q, k, v, out, lse, grad_out, causal, sm_scale, tiles):
    """lessonlib's backward (``ops.flash_attention.backward``) at the dK/dV kernel's ``tiles``; the dQ kernel takes
    them the other way round, as ``backward_config`` does."""
    block_m, block_n, warps, stages = tiles
    dkdv = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return fa.backward(q, k, v, out, lse, grad_out, causal, sm_scale,
                       {"dkdv": dkdv, "dq": dict(dkdv, BLOCK_M=block_n, BLOCK_N=block_m)})


BACKWARDS = {Impl.BACKWARD_TWO_KERNELS: two_kernel_backward, Impl.BACKWARD_ATOMIC_DQ: atomic_backward}


# --- the run ---------------------------------------------------------------------------------------------------

def largest_error(got, want) -> float:
    """The largest absolute difference over tensors of the same shapes (never broadcast: a wrong shape raises)."""
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        raise ValueError(f"shapes {[tuple(g.shape) for g in got]} against {[tuple(w.shape) for w in want]}")
    return max((g.float() - w).abs().max().item() for g, w in zip(got, want))


def timer(smoke):
    """bench's timer; in a smoke run one repetition after the warm-up (the interpreter's seconds are not the point)."""
    return (lambda fn: time_fn(fn, cpu_reps=1)) if smoke else time_fn


def record_checked(run, op, impl, shape, fn, want, allowed, flops, tiles):
    """Check ``fn()`` against ``want`` (within ``allowed``), then time it. A configuration Triton cannot compile or
    fit, or one whose result is wrong (Triton 3.6's warp specialization returns NaN for one of them: NOTES), is
    recorded with its error and not timed."""
    label = {"tiles": list(tiles)}
    try:
        got = fn()
    except Exception as failure:  # noqa: BLE001 - Triton's compile errors have no common class
        run.record(op, impl, shape, None, error=f"{type(failure).__name__}: {str(failure).splitlines()[0][:200]}",
                   **label)
        return
    error = largest_error(got, want)
    if not error <= allowed:
        run.record(op, impl, shape, None, error=f"wrong result: largest error {error:.3g} past the allowed "
                   f"{allowed:.3g}", **label)
        return
    run.measure(op, impl, shape, fn, flops=flops, timer=timer(run.smoke), max_error=float(f"{error:.3g}"), **label)


def main():
    args = bench.parse_args(__doc__, "bench_flash_attention_schedules.py")
    smoke = args.smoke
    run = bench.Run(Benchmark.FLASH_ATTENTION_SCHEDULES, smoke=smoke, check_only=args.check)
    warm_up_gpu()
    batch, heads, n, head_dim = SMOKE_SHAPE if smoke else SHAPE
    forward_tiles = SMOKE_FORWARD_TILES if smoke else FORWARD_TILES
    backward_tiles = {Impl.BACKWARD_TWO_KERNELS: SMOKE_BACKWARD_TILES if smoke else TWO_KERNEL_TILES,
                      Impl.BACKWARD_ATOMIC_DQ: SMOKE_BACKWARD_TILES if smoke else ATOMIC_TILES}
    implementations = {impl: fn for impl, fn in peers().items() if impl in (Impl.LESSONLIB, Impl.SDPA_CUDNN,
                                                                            Impl.SDPA_FLASH, Impl.SDPA)}
    sm_scale = head_dim ** -0.5
    for causal in (False, True):
        torch.manual_seed(0)
        q, k, v, grad_out = (torch.randn(batch, heads, n, head_dim, device=runtime.device()).to(run.dtype)
                             for _ in range(4))
        shape = {"B": batch, "H": heads, "N": n, "D": head_dim, "causal": causal}
        flops = forward_flops(batch, heads, n, n, head_dim, causal)
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        want_out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        want_grads = torch.autograd.grad(want_out, leaves, grad_out.float())
        del leaves
        out, lse = fa._forward(q, k, v, causal, sm_scale)
        if not causal:  # the descriptor kernels are non-causal
            allowed = 2 * largest_error([out], [want_out])
            for impl, fn in implementations.items():  # a backend this GPU (or profile) lacks: its error, recorded
                run.measure(Op.FORWARD, impl, shape, lambda fn=fn: fn(q, k, v, causal), flops=flops,
                            timer=timer(smoke), may_fail=impl != Impl.LESSONLIB)
            for impl, (warp_specialize, persistent) in FORWARDS.items():
                for tiles in forward_tiles:
                    record_checked(run, Op.FORWARD, impl, shape,
                                   lambda t=tiles, w=warp_specialize, p=persistent: [tma_forward(q, k, v, t, w, p)],
                                   [want_out], allowed, flops, tiles)
        del want_out
        allowed = 2 * largest_error(fa.backward(q, k, v, out, lse, grad_out, causal, sm_scale), want_grads)
        run.notes[f"backward allowed error, causal={causal}"] = float(f"{allowed:.3g}")
        for impl, fn in implementations.items():
            try:
                closure = backward_of(fn, q, k, v, causal)  # runs the forward: a missing backend raises here
            except RuntimeError as error:
                if impl == Impl.LESSONLIB:
                    raise
                run.record(Op.BACKWARD, impl, shape, None,
                           error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            run.measure(Op.BACKWARD, impl, shape, closure, flops=2.5 * flops, timer=timer(smoke),
                        may_fail=impl != Impl.LESSONLIB)
            del closure
        for impl, backward in BACKWARDS.items():
            for tiles in backward_tiles[impl]:
                record_checked(run, Op.BACKWARD, impl, shape,
                               lambda b=backward, t=tiles: b(q, k, v, out, lse, grad_out, causal, sm_scale, t),
                               want_grads, allowed, 2.5 * flops, tiles)
        del q, k, v, grad_out, out, lse, want_grads
    run.notes["default_backward_config"] = fa.backward_config(head_dim)
    run.notes["forward allowed error"] = "twice lessonlib's own forward's largest error against float32 SDPA"
    run.save(args.out, {})


if __name__ == "__main__":
    main()
