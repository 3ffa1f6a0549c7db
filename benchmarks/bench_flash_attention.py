"""Lesson 02's benchmark: FlashAttention forward and backward against PyTorch's SDPA backends and naive attention.

    python benchmarks/bench_flash_attention.py --out lessonlib/results/flash-attention-h200.json

bf16. TFLOP/s counts 4·B·H·N²·D for the forward (halved when causal) and 2.5 times that for the backward. Peers
measured in the same run: SDPA forced onto each backend (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION),
and naive attention (``lessonlib.reference.attention``: the full score matrix, until it runs out of memory). Also:
a bounded sweep of the forward kernel's tile configurations at the two target shapes (every one recorded), decode
(one query over a long KV sequence) as GB/s of K and V read, and the real error SDPA raises when a backend is forced
onto inputs it cannot take. Every lessonlib case is checked against the float64 reference first.

Where the forward's time goes: ``_forward_variant_kernel`` is a copy of lessonlib's forward loop (non-causal, whole
tiles) with one thing changed per variant, timed at the non-causal target shapes beside the unchanged copy (which
must match lessonlib's own time): the matrix products alone (no softmax: timing only, not attention), rescaling only
when a row's maximum grew by more than 2^8 (FlashAttention-4's trick), and exp2 in 16 bits (twice the elements per
special-function instruction).
``--smoke`` runs tiny sizes in any mode (it tests this script).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lessonlib import ops, reference, runtime  # noqa: E402

runtime.mode()  # chosen before the kernel below is defined
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lessonlib.ops.flash_attention import backward, backward_config, forward_config  # noqa: E402
from lessonlib.measure import gbps, time_copy, time_fn, warm_up_gpu  # noqa: E402
from lessonlib.results import Results, environment  # noqa: E402
from lessonlib.testing import check_close, to_float64  # noqa: E402

SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


FORWARD_VARIANTS = {0: "loop copy, unchanged", 1: "matrix products alone (no softmax)",
                    2: "lazy rescale (FlashAttention-4)", 3: "exp2 in 16 bits"}


@triton.jit
def _forward_variant_kernel(q_ptr, k_ptr, v_ptr, out_ptr, n, stride_n, qk_scale, VARIANT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """lessonlib's forward loop for (B*H, N, D) inputs with row stride ``stride_n`` (a run-time value, as in
    lessonlib), non-causal, N a multiple of both tiles, with one change per VARIANT (see FORWARD_VARIANTS).
    Variant 1 computes no attention: it is there to be timed."""
    start_m = tl.program_id(0) * BLOCK_M
    base = tl.program_id(1).to(tl.int64) * n * stride_n
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + base + offs_m[:, None] * stride_n + offs_d[None, :])
    k_tile = offs_n[None, :] * stride_n + offs_d[:, None]
    v_tile = offs_n[:, None] * stride_n + offs_d[None, :]
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, n, BLOCK_N):
        s = tl.dot(q, tl.load(k_ptr + base + tl.cast(start_n, tl.int64) * stride_n + k_tile))
        v = tl.load(v_ptr + base + tl.cast(start_n, tl.int64) * stride_n + v_tile)
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
            if VARIANT == 3:
                p = _exp2_16bit(s * qk_scale - m_new[:, None], v.dtype)
            else:
                p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    if VARIANT != 1:
        acc = acc / l_i[:, None]
    tl.store(out_ptr + base + offs_m[:, None] * stride_n + offs_d[None, :], acc.to(out_ptr.dtype.element_ty))


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


def forward_flops(batch, heads, n_q, n_kv, head_dim, causal):
    flops = 4 * batch * heads * n_q * n_kv * head_dim
    return flops / 2 if causal else flops


def sdpa_with(backend: str | None):
    """SDPA forced onto one backend (None: PyTorch's own choice)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v, causal):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def lessonlib_attention(q, k, v, causal, **kwargs):
    return ops.flash_attention(q, k, v, causal=causal, **kwargs)


def naive_attention(q, k, v, causal):
    return reference.attention(q, k, v, causal=causal)


def backward_of(fn, q, k, v, causal):
    """A closure timing only the backward: the forward runs once, its graph is kept for every repetition."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any mode: tests this script")
    args = parser.parse_args()
    if not args.smoke and not runtime.on_gpu():
        sys.exit("bench_flash_attention.py needs a GPU (use --smoke to test the script on CPU)")
    device = runtime.device()
    dtype = runtime.dtype()  # bfloat16 where the GPU has it, float16 on a T4 and in the interpreter
    records, notes = [], {}
    warm_up_gpu()

    def record(op, impl, shape, us, **extra):
        rec = {"op": op, "impl": impl, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
               "us": None if us is None else round(us, 3), **extra}
        records.append(rec)
        shown = "   " + ", ".join(f"{k}={v}" for k, v in extra.items())
        print(f"{op:14s} {impl:34s} {str(shape):70s} {'-' if us is None else f'{us:10.1f} us'}{shown}", flush=True)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)

    peers = {"lessonlib": lessonlib_attention, "naive": naive_attention}
    if runtime.on_gpu():
        peers.update({f"SDPA {b.split('_')[0].lower()}": sdpa_with(b) for b in SDPA_BACKENDS})
    else:
        peers["SDPA"] = sdpa_with(None)

    def measure(op, impl, fn, shape, flops):
        try:
            us = time_fn(fn).median_us
        except (torch.OutOfMemoryError, RuntimeError) as error:  # naive at long N; a backend refusing a shape
            if isinstance(error, RuntimeError) and "out of memory" not in str(error).lower() and impl == "lessonlib":
                raise
            record(op, impl, shape, None, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            torch.cuda.empty_cache() if runtime.on_gpu() else None
            return
        record(op, impl, shape, us, tflops=float(f"{flops / (us * 1e-6) / 1e12:.4g}"))

    # The target shapes, then a sweep of N for the notebook's plot (B·N kept at 16k tokens).
    targets = [(2, 32, 4096, 128, False), (2, 32, 4096, 128, True), (4, 16, 2048, 64, True)]
    sweep = [(max(1, 16384 // n), 32, n, 128, causal) for n in (512, 1024, 2048, 4096, 8192, 16384) for causal in (False, True)]
    cases = [(1, 2, 40, 32, False), (1, 2, 40, 32, True), (2, 2, 64, 16, True)] if args.smoke else targets + sweep
    for batch, heads, n, head_dim, causal in dict.fromkeys(cases):
        q, k, v = randn(batch, heads, n, head_dim), randn(batch, heads, n, head_dim), randn(batch, heads, n, head_dim)
        one = (q[:1, :2], k[:1, :2], v[:1, :2])  # correctness on a slice: float64 scores of every head cost 10s of GB
        check_close("flash_attention", ops.flash_attention(*one, causal=causal),
                    reference.attention(*to_float64(*one), causal=causal), reference.attention(*one, causal=causal))
        shape = {"B": batch, "H": heads, "N": n, "D": head_dim, "causal": causal}
        flops = forward_flops(batch, heads, n, n, head_dim, causal)
        for impl, fn in peers.items():
            measure("forward", impl, lambda fn=fn: fn(q, k, v, causal), shape, flops)
        for impl, fn in peers.items():
            if impl == "naive" and n > 4096:
                continue  # its backward keeps the score matrix and its gradient: beyond this it only measures OOM
            try:
                closure = backward_of(fn, q, k, v, causal)
            except (torch.OutOfMemoryError, RuntimeError) as error:
                record("backward", impl, shape, None, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            measure("backward", impl, closure, shape, 2.5 * flops)
            del closure
        del q, k, v

    # A bounded sweep of the kernels' tiles at the target shapes: every configuration checked, then recorded.
    forward_configs = [dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)] if args.smoke else [
        dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        for bm, bn, w, st in ((64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 64, 4, 4), (128, 128, 8, 3),
                              (64, 128, 4, 3))]
    backward_configs = [backward_config(32)] if args.smoke else [
        {"dkdv": dict(BLOCK_M=mk, BLOCK_N=nk, num_warps=w, num_stages=st),
         "dq": dict(BLOCK_M=mq, BLOCK_N=nq, num_warps=w, num_stages=st)}
        for (mk, nk), (mq, nq), w, st in (((32, 64), (64, 32), 4, 3), ((32, 64), (64, 32), 4, 2),
                                          ((32, 128), (128, 32), 8, 3), ((64, 128), (128, 64), 8, 2))]
    for batch, heads, n, head_dim, causal in (cases[:2] if args.smoke else targets):
        q, k, v = randn(batch, heads, n, head_dim), randn(batch, heads, n, head_dim), randn(batch, heads, n, head_dim)
        one = (q[:1, :2], k[:1, :2], v[:1, :2])
        truth, low = reference.attention(*to_float64(*one), causal=causal), reference.attention(*one, causal=causal)
        shape = {"B": batch, "H": heads, "N": n, "D": head_dim, "causal": causal}
        flops = forward_flops(batch, heads, n, n, head_dim, causal)
        for config in forward_configs:
            label = "lessonlib " + " ".join(f"{k}={v}" for k, v in config.items())
            check_close(f"flash_attention {label}", ops.flash_attention(*one, causal=causal, config=config), truth, low)
            measure("forward", label, lambda c=config: ops.flash_attention(q, k, v, causal=causal, config=c), shape,
                    flops)
        scale = head_dim ** -0.5
        out, lse = ops.flash_attention(q, k, v, causal=causal, return_lse=True)
        grad = torch.randn_like(out)
        for config in backward_configs:
            label = "lessonlib " + " | ".join(f"{kernel} " + " ".join(f"{k}={v}" for k, v in c.items())
                                               for kernel, c in config.items())
            measure("backward", label, lambda c=config: backward(q, k, v, out, lse, grad, causal, scale, config=c),
                    shape, 2.5 * flops)
        del q, k, v, out, lse, grad
    notes["default_configs"] = {f"D={d}": {"forward": forward_config(d), "backward": backward_config(d)}
                                for d in (64, 128)}

    # Where the forward's time goes: the loop copied, changed one way at a time, at the non-causal target shapes.
    variant_cases = [(1, 2, 64, 32)] if args.smoke else [(2, 32, 4096, 128), (4, 16, 2048, 64)]
    # Variant 3's inline PTX: ex2.approx.ftz.bf16x2 exists from sm_90 only (ptxas refuses it on an A100 or L4),
    # ex2.approx.f16x2 from sm_75. The interpreter runs no inline PTX.
    profile = runtime.gpu_profile()
    has_ex2_16x2 = profile is not None and profile.arch >= (90 if dtype == torch.bfloat16 else 75)
    variants = [0, 1, 2] + ([3] if has_ex2_16x2 else [])
    for batch, heads, n, head_dim in variant_cases:
        q, k, v = randn(batch, heads, n, head_dim), randn(batch, heads, n, head_dim), randn(batch, heads, n, head_dim)
        shape = {"B": batch, "H": heads, "N": n, "D": head_dim, "causal": False}
        flops = forward_flops(batch, heads, n, n, head_dim, False)
        one = (q[:1, :2], k[:1, :2], v[:1, :2])
        truth, low = reference.attention(*to_float64(*one)), reference.attention(*one)
        measure("forward variant", "lessonlib", lambda: ops.flash_attention(q, k, v), shape, flops)  # beside its copy
        for variant in variants:
            if variant == 0:
                check_close("forward variant 0", forward_variant(*one, 0), truth, low)
            elif variant > 1:  # variant 1 is not attention; the others are timed whatever their error, and say it
                try:
                    check_close(f"forward variant {variant}", forward_variant(*one, variant), truth, low)
                    notes[f"forward variant {variant} check, D={head_dim}"] = "passed"
                except AssertionError as error:
                    notes[f"forward variant {variant} check, D={head_dim}"] = str(error)
            measure("forward variant", FORWARD_VARIANTS[variant], lambda i=variant: forward_variant(q, k, v, i),
                    shape, flops)
        del q, k, v

    # Decode: one query per sequence over its whole KV: the bytes of K and V are the time.
    decode_cases = [(2, 4, 64, 32)] if args.smoke else [(32, 32, n, 128) for n in (1024, 4096, 16384)]
    for batch, heads, n, head_dim in decode_cases:
        q, k, v = randn(batch, heads, 1, head_dim), randn(batch, heads, n, head_dim), randn(batch, heads, n, head_dim)
        nbytes = 2 * k.numel() * k.element_size()
        shape = {"B": batch, "H": heads, "Nq": 1, "Nkv": n, "D": head_dim}
        for impl, fn in peers.items():
            try:
                us = time_fn(lambda fn=fn: fn(q, k, v, False)).median_us
            except RuntimeError as error:
                record("decode", impl, shape, None, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            record("decode", impl, shape, us, gbps=float(f"{nbytes / (us * 1e-6) / 1e9:.4g}"))

    # What SDPA says when a backend is forced onto inputs it cannot take (FlashAttention has no float32 kernel).
    if runtime.on_gpu():
        q = torch.randn(1, 2, 64, 64, device=device)
        try:
            sdpa_with("FLASH_ATTENTION")(q, q, q, False)
            notes["forced_backend_error"] = "no error"
        except RuntimeError as error:
            notes["forced_backend_error"] = f"{type(error).__name__}: {error}"[:1500]
        notes["forced_backend_case"] = "FLASH_ATTENTION forced on float32 inputs (1, 2, 64, 64)"

    ceiling_bytes = 1 << (20 if args.smoke else 32)
    ceilings = {"bandwidth_gbs": round(gbps(ceiling_bytes, time_copy(ceiling_bytes)), 1), "matmul_tflops": None}
    if runtime.on_gpu():
        from lessonlib.measure import measure_ceilings

        ceilings = {"bandwidth_gbs": ceilings["bandwidth_gbs"], "matmul_tflops": round(measure_ceilings().matmul_tflops, 1)}
    results = Results("flash_attention", " ".join(["python", *sys.argv]), environment(), ceilings, records, notes)
    print("wrote", results.save(args.out))


if __name__ == "__main__":
    main()
