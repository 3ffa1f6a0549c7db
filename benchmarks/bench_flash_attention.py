"""Lesson 02's benchmark: FlashAttention forward and backward against PyTorch's SDPA backends and naive attention.

    python -m benchmarks.bench_flash_attention --out lessonlib/results/flash-attention-h200.json

bf16. TFLOP/s counts 4·B·H·N²·D for the forward (halved when causal) and 2.5 times that for the backward. Peers
measured in the same run: SDPA forced onto each backend (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION),
and naive attention (``lessonlib.reference.attention``: the full score matrix, until it runs out of memory). Also:
a bounded sweep of the forward kernel's tile configurations at the two target shapes (every one recorded), decode
(one query over a long KV sequence) as GB/s of K and V read, and the real error SDPA raises when a backend is forced
onto inputs it cannot take. Every lessonlib case is checked against the float64 reference first.

Where the forward's time goes: ``_forward_variant_kernel`` runs lessonlib's forward loop (non-causal, whole tiles:
``_attend_tiles`` itself, called, not copied) or that loop with one thing changed per variant, timed at the
non-causal target shapes beside lessonlib's own kernel (which the unchanged loop must match): the matrix products
alone (no softmax: timing only, not attention), rescaling only when a row's maximum grew by more than 2^8
(FlashAttention-4's trick), and exp2 in 16 bits (twice the elements per special-function instruction).

What attention's kernel absorbs (``Op.ABSORBED``, the claims table of lesson 05): the softmax scale, folded into
lessonlib's exp2, beside Q scaled in a pass of its own first; and dropout, SDPA at ``dropout_p`` 0 and 0.1 on each
backend (flash and memory-efficient draw the mask inside the kernel from a seed; math writes scores and mask out).
``--smoke`` runs tiny sizes in any mode (it tests this script).
"""

from __future__ import annotations

import torch

from lessonlib import bench, ops, reference, runtime, sdpa

runtime.mode()  # chosen before the kernel below is defined
import triton
import triton.language as tl

from lessonlib.bench import Case
from lessonlib.cases.flash_attention import forward_flops, inputs, peers, speed_cases
from lessonlib.measure import gbps, measure_ceilings, time_copy, warm_up_gpu
from lessonlib.ops.flash_attention import _attend_tiles, backward, backward_config, forward_config
from lessonlib.results import Benchmark, Impl, Op, kernels_sweep_label, sweep_label
from lessonlib.testing import check_close, to_float64

# (batch, heads, N, head_dim, causal): the target shapes, then N swept for the notebook's plot (B·N = 16k tokens).
TARGETS = [(2, 32, 4096, 128, False), (2, 32, 4096, 128, True), (4, 16, 2048, 64, True)]
N_SWEEP = [(max(1, 16384 // n), 32, n, 128, causal) for n in (512, 1024, 2048, 4096, 8192, 16384)
           for causal in (False, True)]
SMOKE_SHAPES = [(1, 2, 40, 32, False), (1, 2, 40, 32, True), (2, 2, 64, 16, True)]
# A bounded sweep of the kernels' tiles at the target shapes (ops.flash_attention's and backward's config=).
FORWARD_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st) for bm, bn, w, st in (
    (64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 64, 4, 4), (128, 128, 8, 3), (64, 128, 4, 3))]
SMOKE_FORWARD_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)]
BACKWARD_CONFIGS = [{"dkdv": dict(BLOCK_M=mk, BLOCK_N=nk, num_warps=w, num_stages=st),
                     "dq": dict(BLOCK_M=mq, BLOCK_N=nq, num_warps=w, num_stages=st)}
                    for (mk, nk), (mq, nq), w, st in (((32, 64), (64, 32), 4, 3), ((32, 64), (64, 32), 4, 2),
                                                      ((32, 128), (128, 32), 8, 3), ((64, 128), (128, 64), 8, 2))]
VARIANT_SHAPES, SMOKE_VARIANT_SHAPES = [(2, 32, 4096, 128), (4, 16, 2048, 64)], [(1, 2, 64, 32)]
DECODE_SHAPES = [(32, 32, n, 128) for n in (1024, 4096, 16384)]  # (batch, heads, KV length, head_dim)
SMOKE_DECODE_SHAPES = [(2, 4, 64, 32)]

ABSORB_SHAPES, SMOKE_ABSORB_SHAPES = TARGETS[:2], [(1, 1, 24, 32, True)]
# smoke: odd N, causal, D=32 (the scale 2^-2.5 is inexact, so the pass of its own rounds Q once more)
DROPOUT_P = 0.1  # a common training value; 0 is timed beside it
ABSORB_SDPA = {"FLASH_ATTENTION": Impl.SDPA_FLASH, "EFFICIENT_ATTENTION": Impl.SDPA_EFFICIENT,
               "CUDNN_ATTENTION": Impl.SDPA_CUDNN, "MATH": Impl.SDPA_MATH}

FORWARD_VARIANTS = {0: Impl.LOOP_COPY, 1: Impl.MATMULS_ONLY, 2: Impl.LAZY_RESCALE, 3: Impl.EXP2_16BIT}


@triton.jit
def _forward_variant_kernel(q_ptr, k_ptr, v_ptr, out_ptr, n, stride_n, qk_scale, VARIANT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """lessonlib's forward for (B*H, N, D) inputs with row stride ``stride_n`` (a run-time value, as in lessonlib),
    non-causal, N a multiple of both tiles: VARIANT 0 runs lessonlib's own loop (``_attend_tiles``), the others
    :func:`_changed_tiles` (see FORWARD_VARIANTS). Variant 1 computes no attention: it is there to be timed."""
    start_m = tl.program_id(0) * BLOCK_M
    base = tl.program_id(1).to(tl.int64) * n * stride_n
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + base + offs_m[:, None] * stride_n + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if VARIANT == 0:
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_ptr + base, v_ptr + base, stride_n, stride_n, start_m, 0,
                                      n, n, 0, qk_scale, False, False, BLOCK_M, BLOCK_N, HEAD_DIM)
    else:
        acc, m_i, l_i = _changed_tiles(acc, m_i, l_i, q, k_ptr + base, v_ptr + base, stride_n, n, qk_scale, VARIANT,
                                       BLOCK_N, HEAD_DIM)
    if VARIANT != 1:
        acc = acc / l_i[:, None]
    tl.store(out_ptr + base + offs_m[:, None] * stride_n + offs_d[None, :], acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _changed_tiles(acc, m_i, l_i, q, k_base, v_base, stride_n, n, qk_scale, VARIANT: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``_attend_tiles``' unmasked loop with one change per VARIANT (1, 2, 3). The loop itself is repeated here
    because Triton cannot pass a changed loop body into a jitted function: only the lines under each VARIANT differ."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_tile = offs_n[None, :] * stride_n + offs_d[:, None]
    v_tile = offs_n[:, None] * stride_n + offs_d[None, :]
    for start_n in range(0, n, BLOCK_N):
        s = tl.dot(q, tl.load(k_base + tl.cast(start_n, tl.int64) * stride_n + k_tile))
        v = tl.load(v_base + tl.cast(start_n, tl.int64) * stride_n + v_tile)
        if VARIANT == 1:
            acc = tl.dot(s.to(v.dtype), v, acc)
        elif VARIANT == 2:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            if tl.max(m_new - m_i, 0) > 8.0:  # one decision for the whole tile: a reduction across the warps
                alpha = tl.math.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.math.exp2(s * qk_scale - m_i[:, None])  # at most 2^8 while the maximum is stale
            l_i += tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = _exp2_16bit(s * qk_scale - m_new[:, None], v.dtype)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _exp2_16bit(x, dtype: tl.constexpr):
    """2^x rounded to bfloat16 or float16, two elements per instruction (PTX ex2.approx.*16x2; GPU only)."""
    if dtype == tl.bfloat16:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x.to(tl.bfloat16)],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        y = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16,
                                      is_pure=True, pack=2)
    return y


def forward_variant(q, k, v, variant):
    """Run _forward_variant_kernel with lessonlib's forward tiles for this head_dim."""
    batch, heads, n, head_dim = q.shape
    config = forward_config(head_dim)
    if k.shape != q.shape or v.shape != q.shape or n % config["BLOCK_M"] or n % config["BLOCK_N"]:
        raise ValueError(f"forward_variant: q, k, v of one shape with N a multiple of the tiles, got {tuple(q.shape)}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    _forward_variant_kernel[(n // config["BLOCK_M"], batch * heads)](
        q, k, v, out, n, head_dim, head_dim ** -0.5 * 1.4426950408889634, VARIANT=variant, HEAD_DIM=head_dim, **config)
    return out


def tile_sweep_cases(run, shapes, forward_configs, backward_configs):
    """The kernels' tile configurations at the target shapes: each forward configuration checked, then timed."""
    for batch, heads, n, head_dim, causal in shapes:
        q, k, v, one = inputs(run, batch, heads, n, head_dim)
        truth, low = reference.attention(*to_float64(*one), causal=causal), reference.attention(*one, causal=causal)
        shape = {"B": batch, "H": heads, "N": n, "D": head_dim, "causal": causal}
        flops = forward_flops(batch, heads, n, n, head_dim, causal)

        def check(one=one, causal=causal, truth=truth, low=low):
            for config in forward_configs:
                check_close(f"flash_attention {sweep_label(config)}",
                            ops.flash_attention(*one, causal=causal, config=config), truth, low)

        timed = {sweep_label(c): (lambda c=c: ops.flash_attention(q, k, v, causal=causal, config=c))
                 for c in forward_configs}
        yield Case(Op.FORWARD, shape, timed, check, flops=flops)
        out, lse = ops.flash_attention(q, k, v, causal=causal, return_lse=True)
        grad, scale = torch.randn_like(out), head_dim ** -0.5
        yield Case(Op.BACKWARD, shape, {kernels_sweep_label(c): (
            lambda c=c: backward(q, k, v, out, lse, grad, causal, scale, config=c)) for c in backward_configs},
            flops=2.5 * flops)
        del q, k, v, out, lse, grad


def variant_cases(run, shapes):
    """Where the forward's time goes: lessonlib's loop, and that loop changed one way at a time (non-causal)."""
    # Variant 3's inline PTX: ex2.approx.ftz.bf16x2 exists from sm_90 only (ptxas refuses it on an A100 or L4),
    # ex2.approx.f16x2 from sm_75. The interpreter runs no inline PTX.
    profile = runtime.gpu_profile()
    has_ex2_16x2 = profile is not None and profile.arch >= (90 if run.dtype == torch.bfloat16 else 75)
    variants = [0, 1, 2] + ([3] if has_ex2_16x2 else [])
    for batch, heads, n, head_dim in shapes:
        q, k, v, one = inputs(run, batch, heads, n, head_dim)
        shape = {"B": batch, "H": heads, "N": n, "D": head_dim, "causal": False}
        truth, low = reference.attention(*to_float64(*one)), reference.attention(*one)

        def check(one=one, truth=truth, low=low, head_dim=head_dim):
            check_close("forward variant 0", forward_variant(*one, 0), truth, low)
            for variant in variants[2:]:  # variant 1 is not attention; 2 and 3 are timed whatever their error
                try:
                    check_close(f"forward variant {variant}", forward_variant(*one, variant), truth, low)
                    run.notes[f"{Op.FORWARD_VARIANT} {variant} check, D={head_dim}"] = "passed"
                except AssertionError as error:
                    run.notes[f"{Op.FORWARD_VARIANT} {variant} check, D={head_dim}"] = str(error)

        timed = {Impl.LESSONLIB: lambda: ops.flash_attention(q, k, v)}  # beside the loop it runs
        timed.update({FORWARD_VARIANTS[i]: (lambda i=i: forward_variant(q, k, v, i)) for i in variants})
        yield Case(Op.FORWARD_VARIANT, shape, timed, check,
                   flops=forward_flops(batch, heads, n, n, head_dim, False))
        del q, k, v


def decode_cases(run, shapes, implementations):
    """One query per sequence over its whole KV: the bytes of K and V are the time."""
    for batch, heads, n, head_dim in shapes:
        q, k, v, _ = inputs(run, batch, heads, n, head_dim, n_q=1)
        yield Case(Op.DECODE, {"B": batch, "H": heads, "Nq": 1, "Nkv": n, "D": head_dim},
                   {impl: (lambda fn=fn: fn(q, k, v, False)) for impl, fn in implementations.items()},
                   nbytes=2 * k.numel() * k.element_size(), may_fail=tuple(implementations))


def prescaled(q, k, v, causal):
    """The softmax scale applied as its own pass (Q read, Q * scale written), then lessonlib's kernel with scale 1."""
    return ops.flash_attention(q * q.shape[-1] ** -0.5, k, v, causal=causal, sm_scale=1.0)


def dropout_peers(q, k, v, causal, dropout_p):
    """SDPA at ``dropout_p`` on each backend (on CPU: as PyTorch chooses, which the smoke run times)."""
    if not runtime.on_gpu():
        return {Impl.SDPA: lambda: sdpa.scaled_dot_product_attention(q, k, v, causal, dropout_p=dropout_p)}
    return {impl: (lambda b=backend: sdpa.scaled_dot_product_attention(q, k, v, causal, backends=(b,),
                                                                      dropout_p=dropout_p))
            for backend, impl in ABSORB_SDPA.items()}


def absorbed_cases(run, shapes):
    """What attention's kernel absorbs: the scale (folded into exp2 vs a pass of its own) and dropout (SDPA at
    dropout_p 0 and DROPOUT_P). lessonlib has no dropout: it is an inference kernel."""
    for batch, heads, n, head_dim, causal in shapes:
        q, k, v, one = inputs(run, batch, heads, n, head_dim)
        shape = {"B": batch, "H": heads, "N": n, "D": head_dim, "causal": causal}
        flops = forward_flops(batch, heads, n, n, head_dim, causal)

        def check(one=one, causal=causal):
            q1 = one[0] * one[0].shape[-1] ** -0.5  # rounded to the input dtype, as the separate pass stores it
            check_close("Q pre-scaled, then flash_attention", prescaled(*one, causal),
                        reference.attention(*to_float64(q1, *one[1:]), causal=causal, sm_scale=1.0),
                        reference.attention(q1, *one[1:], causal=causal, sm_scale=1.0))
            kept = sdpa.scaled_dot_product_attention(*one, causal)
            if torch.equal(sdpa.scaled_dot_product_attention(*one, causal, dropout_p=DROPOUT_P), kept):
                raise AssertionError(f"SDPA with dropout_p={DROPOUT_P} returned the output without dropout")

        scale_peers = {Impl.LESSONLIB: lambda: ops.flash_attention(q, k, v, causal=causal),
                       Impl.PRESCALED_Q: lambda: prescaled(q, k, v, causal)}
        yield Case(Op.ABSORBED, {**shape, "dropout_p": 0.0}, scale_peers, check, flops=flops)
        for dropout_p in (0.0, DROPOUT_P):
            peers_ = dropout_peers(q, k, v, causal, dropout_p)
            yield Case(Op.ABSORBED, {**shape, "dropout_p": dropout_p}, peers_, flops=flops, may_fail=tuple(peers_))
        del q, k, v


def forced_backend_error() -> dict:
    """What SDPA says when a backend is forced onto inputs it cannot take (FlashAttention has no float32 kernel)."""
    q = torch.randn(1, 2, 64, 64, device=runtime.device())
    try:
        sdpa.scaled_dot_product_attention(q, q, q, False, backends=("FLASH_ATTENTION",))
        error = "no error"
    except RuntimeError as raised:
        error = f"{type(raised).__name__}: {raised}"[:1500]
    return {"forced_backend_error": error,
            "forced_backend_case": "FLASH_ATTENTION forced on float32 inputs (1, 2, 64, 64)"}


def main():
    args = bench.parse_args(__doc__, "bench_flash_attention.py")
    smoke = args.smoke
    run = bench.Run(Benchmark.FLASH_ATTENTION, smoke=smoke, check_only=args.check)
    warm_up_gpu()
    implementations = peers()
    shapes = SMOKE_SHAPES if smoke else TARGETS + N_SWEEP
    run.cases(speed_cases(run, shapes, implementations))
    run.cases(tile_sweep_cases(run, SMOKE_SHAPES[:2] if smoke else TARGETS,
                               SMOKE_FORWARD_CONFIGS if smoke else FORWARD_CONFIGS,
                               [backward_config(32)] if smoke else BACKWARD_CONFIGS))
    run.notes["default_configs"] = {f"D={d}": {"forward": forward_config(d), "backward": backward_config(d)}
                                    for d in (64, 128)}
    run.cases(variant_cases(run, SMOKE_VARIANT_SHAPES if smoke else VARIANT_SHAPES))
    run.cases(decode_cases(run, SMOKE_DECODE_SHAPES if smoke else DECODE_SHAPES, implementations))
    run.cases(absorbed_cases(run, SMOKE_ABSORB_SHAPES if smoke else ABSORB_SHAPES))
    if runtime.on_gpu():
        run.notes.update(forced_backend_error())
    ceiling_bytes = 1 << (20 if smoke else 32)
    matmul = round(measure_ceilings().matmul_tflops, 1) if runtime.on_gpu() else None
    bandwidth = round(gbps(ceiling_bytes, time_copy(ceiling_bytes)), 1)
    run.save(args.out, {"bandwidth_gbs": bandwidth, "matmul_tflops": matmul})


if __name__ == "__main__":
    main()
